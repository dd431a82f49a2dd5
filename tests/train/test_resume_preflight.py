"""`raggedvl train --resume` with settings or data its checkpoint cannot continue with fails in
the launching process, in one line with exit code 2, naming each key's old and new value and
the fix (a fresh --output-dir or the original values), before any rank starts.

The checkpoint here is what the launcher reads of one: ``trainer_state.json`` (the run's config,
world size and sampler state, the state a real sampler over the same data writes) listed with
its SHA-256 in ``MANIFEST.json``."""

import hashlib
import json
import shutil

import pytest
import torch

from raggedvl.app.cli import main
from raggedvl.parallel import DistInfo
from raggedvl.app import launch
from raggedvl.app.config import TrainConfig
from raggedvl.app.resume import RESUME_CHECKED_ENV
from raggedvl.app.setup import make_sampler, prepare_run_data
from tests.train.test_preflight import _parquet

pytestmark = pytest.mark.slow  # opens the data and builds the tiny processor (the size estimate)

COMMON = ["--eval-before", "false", "--eval-after", "false", "--max-train-samples", "none", "--global-batch-size", "4"]


def _config(run, data, cache) -> TrainConfig:
    """The config of the run that wrote the checkpoint (the settings COMMON gives)."""
    return TrainConfig(output_dir=str(run), dataset=str(data), data_cache=str(cache), eval_before=False,
                       eval_after=False, max_train_samples=None, global_batch_size=4)


class Started(Exception):
    """The launcher got past every check and would start the ranks."""


@pytest.fixture(autouse=True)
def _never_start_ranks(monkeypatch):
    def started(cmd, env_updates=None):
        raise Started(cmd, env_updates)

    monkeypatch.setattr(launch, "exec_agent", started)


def _write_checkpoint(run, cfg: TrainConfig, world_size: int, step: int = 2):
    """A checkpoint folder as the launcher reads it (the weights are the rank's business)."""
    info = DistInfo(rank=0, world_size=world_size, local_rank=0, device=torch.device("cpu"), backend="none")
    data = prepare_run_data(cfg, warn=False)
    sampler = make_sampler(cfg, data.costs, info, data.train_set.part_sizes)
    sampler.set_epoch(0)
    next(iter(sampler))
    folder = run / "checkpoints" / f"step-{step:06d}"
    folder.mkdir(parents=True)
    state = {"step": step, "epoch": 0, "world_size": world_size, "sampler": sampler.state_dict(), "scheduler": {},
             "config": cfg.to_dict()}
    raw = json.dumps(state).encode()
    (folder / "trainer_state.json").write_bytes(raw)
    (folder / "MANIFEST.json").write_text(json.dumps(
        {"step": step, "files": {"trainer_state.json": {"bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}}}))
    return folder


def _resume(capsys, run, data, cache, *argv):
    capsys.readouterr()
    code = main(["train", "--output-dir", str(run), "--dataset", str(data), "--data-cache", str(cache), *COMMON,
                 "--resume", *argv])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("raggedvl: error: --resume: "), err
    return err


def test_other_settings_are_refused_naming_old_and_new_values(capsys, monkeypatch, tmp_path, small_data_cache):
    data = _parquet(tmp_path / "pairs.parquet", n=8)
    cfg = _config(tmp_path / "run", data, small_data_cache)
    folder = _write_checkpoint(tmp_path / "run", cfg, world_size=2)
    other = _parquet(tmp_path / "other.parquet", n=12)
    err = _resume(capsys, tmp_path / "run", other, small_data_cache, "--nproc-per-node", "2", "--lr", "1e-3",
                  "--dim", "64", "--temperature", "0.05", "--false-negatives", "keep")
    assert f"{folder} cannot continue with these settings" in err
    assert f"--dataset {data!r} then, {other!r} now" in err
    assert "--dim 128 then, 64 now" in err and "--lr 0.0002 then, 0.001 now" in err
    assert "--temperature 0.02 then, 0.05 now" in err and "--false-negatives 'mask' then, 'keep' now" in err
    assert "new --output-dir" in err and "original values" in err
    with pytest.raises(Started) as started:  # another number of processes continues, and says so in one line
        main(["train", "--output-dir", str(tmp_path / "run"), "--dataset", data, "--data-cache", str(small_data_cache),
              *COMMON, "--resume", "--nproc-per-node", "3"])
    err = capsys.readouterr().err
    assert f"{folder} was written by 2 processes and continues on 3: the same global batches" in err, err
    assert err.count("\n") == 1, err
    assert started.value.args[1][RESUME_CHECKED_ENV] == "1"  # the ranks know it was said: rank 0 does not repeat it
    with pytest.raises(Started):  # the same settings: every check passes, the ranks would start
        main(["train", "--output-dir", str(tmp_path / "run"), "--dataset", data, "--data-cache", str(small_data_cache),
              *COMMON, "--resume", "--nproc-per-node", "2", "--max-steps", "20"])  # a longer run may continue
    monkeypatch.chdir(tmp_path)
    with pytest.raises(Started):  # the same file by a relative spelling is the same data
        main(["train", "--output-dir", "run", "--dataset", "pairs.parquet", "--data-cache", str(small_data_cache),
              *COMMON, "--resume", "--nproc-per-node", "2"])


def test_data_rewritten_under_the_same_name_is_refused(capsys, tmp_path, small_data_cache):
    data = _parquet(tmp_path / "pairs.parquet", n=8)
    cfg = _config(tmp_path / "run", data, small_data_cache)
    _write_checkpoint(tmp_path / "run", cfg, world_size=2)
    _parquet(tmp_path / "pairs.parquet", n=9)  # one more pair, same file name
    err = _resume(capsys, tmp_path / "run", data, small_data_cache, "--nproc-per-node", "2")
    assert f"was trained on other training data than {data!r} holds now" in err
    assert "num_samples: saved 8, now 9" in err and "new --output-dir" in err


def test_a_rank_started_by_torchrun_itself_gives_the_same_message(tmp_path, small_data_cache):
    """`torchrun -m raggedvl.app.cli train --resume` skips the launcher: Checkpointer.resume applies the
    same check to a real checkpoint, before loading it."""
    from raggedvl.app.loop import train
    from tests.conftest import SMALL_DEV_PAIRS, SMALL_TRAIN_PAIRS

    cfg = TrainConfig(output_dir=str(tmp_path / "run"), data_cache=str(small_data_cache), max_steps=1,
                      max_train_samples=SMALL_TRAIN_PAIRS, max_eval_samples=SMALL_DEV_PAIRS, global_batch_size=4,
                      eval_before=False, eval_after=False)
    train(cfg)
    with pytest.raises(ValueError, match=r"step-000001 cannot continue with these settings: --lr 0\.0002 then, "
                                         r"0\.001 now\. Pass the original values"):
        train(TrainConfig(**{**cfg.to_dict(), "resume": True, "lr": 1e-3, "max_steps": 2}))


def test_resume_of_a_mistyped_folder_says_there_is_nothing_and_suggests_the_run(capsys, tmp_path, small_data_cache):
    data = _parquet(tmp_path / "pairs.parquet", n=8)
    _write_checkpoint(tmp_path / "run-a", _config(tmp_path / "run-a", data, small_data_cache), 1)
    err = _resume(capsys, tmp_path / "run-b", data, small_data_cache)
    assert f"{tmp_path / 'run-b'} holds no checkpoint to resume; did you mean '{tmp_path / 'run-a'}'?" in err, err


def test_resume_of_a_finished_run_says_nothing_is_left(capsys, tmp_path, small_data_cache):
    data = _parquet(tmp_path / "pairs.parquet", n=8)
    run = tmp_path / "run"
    folder = _write_checkpoint(run, _config(run, data, small_data_cache), 2, step=3)
    err = _resume(capsys, run, data, small_data_cache, "--max-steps", "3")
    assert f"{folder} is step 3, and --max-steps is 3: nothing left to train" in err, err
    with pytest.raises(Started):  # a larger --max-steps continues it (the ranks would start)
        main(["train", "--output-dir", str(run), "--dataset", str(data), "--data-cache", str(small_data_cache), *COMMON,
              "--resume", "--max-steps", "5", "--nproc-per-node", "2"])


def test_a_resumed_run_says_each_resume_line_once(tmp_path, capsys, monkeypatch, small_data_cache):
    """A 2-step run resumed with 4 steps: rank 0 says once that the schedule is stretched, and
    the logged rates of steps 3-4 continue step 2's downwards to 0 at step 4 (cosine, warmup 0:
    progress 1/2 at step 2's 0-based index 1, then 1/2 + k / 6 for k = 1, 2; float64, rel 1e-12).
    The line on another number of processes (here forced: one process cannot write a 2-process
    checkpoint) comes from rank 0 only when the launcher did not print it (``resume_checked``)."""
    import math

    from raggedvl.app import checkpointer
    from raggedvl.app.loop import train
    from tests.conftest import SMALL_DEV_PAIRS, SMALL_TRAIN_PAIRS

    cfg = TrainConfig(output_dir=str(tmp_path / "run"), data_cache=str(small_data_cache), max_steps=2,
                      max_train_samples=SMALL_TRAIN_PAIRS, max_eval_samples=SMALL_DEV_PAIRS, global_batch_size=4,
                      eval_before=False, eval_after=False, log_every=1, keep_checkpoints=5)
    train(cfg)
    capsys.readouterr()
    monkeypatch.setattr(checkpointer, "check_resume_settings", lambda *a: "WORLD NOTE")
    for checked, shown in ((True, 0), (False, 1)):
        shutil_run = tmp_path / f"run-{checked}"
        shutil.copytree(tmp_path / "run", shutil_run)
        train(TrainConfig(**{**cfg.to_dict(), "output_dir": str(shutil_run), "resume": True, "max_steps": 4}),
              resume_checked=checked)
        printed = capsys.readouterr()
        out = printed.out + printed.err
        assert out.count("WORLD NOTE") == shown, out
        assert out.count("the learning-rate schedule planned 2 steps and continues to 4") == 1, out
        lrs = {r["step"]: r["lr"] for r in map(json.loads, (shutil_run / "metrics.jsonl").read_text().splitlines())
               if r.get("event") == "train"}
        assert [lrs[s] for s in (3, 4)] == pytest.approx(
            [1e-4 * (1 + math.cos(math.pi * (0.5 + k / 6))) for k in (1, 2)], rel=1e-12)
        assert lrs[2] == pytest.approx(1e-4, rel=1e-12) and lrs[2] > lrs[3] > lrs[4]


def test_resume_of_a_run_folder_without_checkpoint_suggests_no_other_run(capsys, tmp_path, small_data_cache):
    """An existing run folder is no typo: another run with a close name is not offered."""
    data = _parquet(tmp_path / "pairs.parquet", n=8)
    _write_checkpoint(tmp_path / "cc4", _config(tmp_path / "cc4", data, small_data_cache), 1)
    (tmp_path / "cc3").mkdir()
    err = _resume(capsys, tmp_path / "cc3", data, small_data_cache)
    assert f"{tmp_path / 'cc3'} holds no checkpoint to resume (to start a new run there" in err, err
    assert "did you mean" not in err, err

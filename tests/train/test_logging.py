"""What a run logs: plain progress lines outside a terminal, metrics.jsonl's
per-step numbers, ``--report-to tensorboard`` event files (offline, a local log dir); and a
1-process `raggedvl train` runs in the launching process (no torchrun)."""

import io
import json
import math
import re

import pytest

from raggedvl.app.cli import main
from raggedvl.app import launch
from raggedvl.app.config import TrainConfig
from raggedvl.app.progress import Progress, eta_text
from raggedvl.app.tracking import check_installed, parse_report_to

LINE = re.compile(r"^step (\d+)/7 loss [0-9.]+ lr [0-9.]+e[-+]\d\d samples/s [0-9.]+ ETA \d+:\d\d:\d\d$")


def test_progress_outside_a_terminal_is_one_plain_line_every_n_steps():
    stream = io.StringIO()  # not a terminal
    progress = Progress(7, 0, every=3, enabled=True, stream=stream)
    for step in range(1, 8):
        progress.update(step, loss=2.0 / step, lr=1e-4, samples_per_s=3.5)
    progress.close()
    text = stream.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert [int(LINE.match(line).group(1)) for line in lines] == [3, 6, 7]  # every 3rd step and the last
    assert lines[-1].endswith("ETA 0:00:00")
    quiet = io.StringIO()
    Progress(7, 0, every=1, enabled=False, stream=quiet).update(1, loss=1.0, lr=1e-4, samples_per_s=1.0)
    assert quiet.getvalue() == ""  # ranks other than 0


def test_report_to_names_are_checked():
    assert parse_report_to("none") == () and parse_report_to("TensorBoard, tensorboard") == ("tensorboard",)
    with pytest.raises(ValueError, match="unknown tracker 'tensorbord'; did you mean 'tensorboard'"):
        TrainConfig(report_to="tensorbord")
    with pytest.raises(ValueError, match="unknown tracker 'none'"):
        parse_report_to("none,wandb")


def test_tracked_evaluation_scalars_are_the_retrieval_metrics_tagged_by_split():
    from raggedvl.evaluation import METRICS
    from raggedvl.app.tracking import eval_scalars

    metrics = {**{name: 0.5 for name in METRICS}, "mean_rank": 2.0, "random_mean_rank": 4.5, "random_mean_rank_se": 0.3,
               "queries": 8, "documents": 8, "skipped_documents": 0, "doc_mean_cosine": 0.9, "n": 8}
    tags = eval_scalars({"train": metrics, "dev": {**metrics, "ndcg@5": 0.25}})
    assert set(tags) == {f"{prefix}/{name}" for prefix in ("memorisation", "dev")
                         for name in (*METRICS, "mean_rank", "random_mean_rank")}
    assert tags["dev/ndcg@5"] == 0.25 and tags["memorisation/ndcg@5"] == 0.5
    assert "ndcg@10" in METRICS and "recall@5" in METRICS and "mrr@10" in METRICS and "map@10" in METRICS


def test_a_missing_tracker_package_names_its_extra(monkeypatch):
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(ValueError, match=r"--report-to mlflow needs the mlflow package: pip install 'raggedvl\[mlflow\]'"):
        check_installed(("mlflow",))


@pytest.mark.slow  # trains 4 steps of the tiny model (~30 s idle)
def test_one_process_run_logs_plain_lines_metrics_and_tensorboard(tmp_path, capfd, small_data_cache, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def refuse(cmd, env_updates=None):
        raise AssertionError(f"a 1-process run started {cmd}")

    monkeypatch.setattr(launch, "exec_agent", refuse)
    run = tmp_path / "run"
    code = main(["train", "--nproc-per-node", "1", "--max-steps", "4", "--global-batch-size", "4", "--warmup-steps", "2",
                 "--max-train-samples", "16", "--max-eval-samples", "8", "--eval-before", "false", "--eval-after", "true",
                 "--progress-every", "2", "--report-to", "tensorboard", "--output-dir", str(run),
                 "--data-cache", str(small_data_cache)])
    out, err = capfd.readouterr()
    assert code == 0, err[-3000:]
    assert "\r" not in out + err
    assert "raggedvl.app.agent" not in out and "torch.distributed.run" not in out
    assert [line.split(" loss ")[0] for line in err.splitlines() if line.startswith("step ")] == ["step 2/4", "step 4/4"]

    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["event"] == "train"]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert all(math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0 for r in steps)
    for r in steps:  # every group's lr follows one schedule: head_lr / lr = 2e-3 / 2e-4
        assert set(r["lr_groups"]) == {"backbone", "head"} and r["lr"] == r["lr_groups"]["backbone"]
        assert r["lr_groups"]["head"] == pytest.approx(10 * r["lr_groups"]["backbone"])
        assert r["samples_per_s"] > 0 and r["patches_per_s"] > 0 and r["peak_memory_mib"][0] > 0
        assert r["padding"]["pixel_rows"] > 0 and r["padding"]["doc_tokens"] <= r["padding"]["doc_slots"]
    # the lr each step used (read before the scheduler steps): warmup 2 of 4 cosine steps gives
    # 0 (the first warmup value, as transformers' schedule starts), 1/2, then the peak, then cos(pi/2)'s 1/2
    assert [r["lr"] for r in steps] == pytest.approx([0.0, 1e-4, 2e-4, 1e-4], abs=1e-12)
    assert [r["lr_groups"]["head"] for r in steps] == pytest.approx([0.0, 1e-3, 2e-3, 1e-3], abs=1e-12)
    assert "--warmup-steps" not in err  # a warmup of 2 fits in 4 steps: no warning
    assert "world size 1 (single process, cpu)" in out and "rank(s)" not in out
    times = [r["time"] for r in steps]
    assert times == sorted(times)
    startup = next(r for r in records if r["event"] == "startup")
    assert {"imports", "data", "cost_scan", "model", "first_step"} <= set(startup["phases_s"])

    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    loss = events.Scalars("train/loss")
    assert [e.step for e in loss] == [1, 2, 3, 4]
    assert [e.value for e in loss] == pytest.approx([r["loss"] for r in steps], rel=1e-6)
    assert [e.value for e in events.Scalars("lr/head")] == pytest.approx([r["lr_groups"]["head"] for r in steps], rel=1e-6)
    assert [e.value for e in events.Scalars("train/grad_norm")] == pytest.approx([r["grad_norm"] for r in steps], rel=1e-6)
    # the evaluation after training: its retrieval metrics apart from the steps' train/ numbers
    # (memorisation/ for the training pairs scored, dev/ as --save-best logs), no counts or errors
    tags = set(events.Tags()["scalars"])
    after = next(r for r in records if r["event"] == "eval_after")["raw"]
    for split, prefix in (("train", "memorisation"), ("dev", "dev")):
        assert [e.step for e in events.Scalars(f"{prefix}/ndcg@5")] == [4]
        assert events.Scalars(f"{prefix}/ndcg@5")[0].value == pytest.approx(after[split]["ndcg@5"], rel=1e-6)
        assert {f"{prefix}/random_mean_rank", f"{prefix}/mrr@10", f"{prefix}/map@10", f"{prefix}/recall@1"} <= tags
    assert {t for t in tags if t.startswith("train/")} == {"train/loss", "train/grad_norm", "train/samples_per_s",
                                                          "train/patches_per_s", "train/peak_memory_mib"}
    assert not [t for t in tags if t.endswith(("_se", "/queries", "/documents", "/n"))]


def test_a_warmup_longer_than_the_run_is_one_warning_line_with_the_fix(tmp_path, capsys, small_data_cache):
    from raggedvl.parallel import init_distributed
    from raggedvl.app.loop import Trainer, warmup_warning

    assert warmup_warning(3, 4, 2e-4) is None and warmup_warning(0, 1, 2e-4) is None
    line = warmup_warning(10, 4, 2e-4)
    assert line == ("warning: --warmup-steps 10 does not fit in this run's 4 steps (at most 3): the warmup is cut to 3 "
                    "steps, so the learning rate rises for the whole run, reaches its peak (--lr 0.0002) only at the "
                    "last step and never decays; for a warmup then a decay, leave out --warmup-steps (the default "
                    "for 4 steps: 1) or pass more --max-steps")
    assert warmup_warning(10, 1, 2e-4) == ("warning: --warmup-steps 10 does not fit in a 1-step run: its one step runs "
                                           "at the peak learning rate (--lr 0.0002), with no warmup; for a warmup, "
                                           "pass more --max-steps")
    assert "the warmup is cut to 1 step, so" in warmup_warning(10, 2, 2e-4)
    assert "(the default for 2 steps: 0)" in warmup_warning(10, 2, 2e-4)  # 1 would never decay
    assert warmup_warning(None, 4, 2e-4) is None  # not given: the default fits
    cfg = TrainConfig(max_steps=4, warmup_steps=10, global_batch_size=4, max_train_samples=16, max_eval_samples=8,
                      eval_before=False, eval_after=False, output_dir=str(tmp_path / "run"), data_cache=str(small_data_cache))
    trainer = Trainer(cfg, init_distributed())
    assert capsys.readouterr().err.count(line) == 1
    used = []  # what the cut schedule gives: the peak at the last of the 4 steps, as the line says
    for _ in range(4):
        used.append(trainer.scheduler.get_last_lr()[0])
        trainer.optimizer.step()
        trainer.scheduler.step()
    assert used == pytest.approx([0.0, 2e-4 / 3, 4e-4 / 3, 2e-4])


def test_one_line_says_what_a_start_loads_before_its_silent_part(tmp_path, capsys, monkeypatch):
    """The launcher, once its checks pass, prints one line naming the model, the data and the
    processes, before it starts them; a rank prints it only under a torchrun that raggedvl's
    launcher did not start (no ``RAGGEDVL_STARTUP``), and only rank 0."""
    from raggedvl.app import loop
    from raggedvl.app.startup import ENV

    from .test_preflight import _parquet

    for name in ("HF_DATASETS_DISABLE_PROGRESS_BARS", "HF_HUB_DISABLE_PROGRESS_BARS"):
        monkeypatch.setenv(name, "1")  # restored after the test; plain_output sets them
    data = _parquet(tmp_path / "train.parquet")

    class Started(Exception):
        pass

    def started(cmd, env_updates=None):
        raise Started

    monkeypatch.setattr(launch, "exec_agent", started)
    capsys.readouterr()  # what writing the data printed
    argv = ["train", "--model", "tiny", "--dataset", data, "--global-batch-size", "4", "--eval-before", "false",
            "--eval-after", "false", "--output-dir", str(tmp_path / "run")]
    with pytest.raises(Started):
        main([*argv, "--nproc-per-node", "2"])
    assert capsys.readouterr().out == f"raggedvl: loading model tiny and data {data} on 2 processes...\n"

    trained = []
    monkeypatch.setattr(loop, "train", lambda cfg, clock, **_: trained.append(cfg.model))
    monkeypatch.setenv("LOCAL_RANK", "0")  # a rank: it trains (the stub) in this process
    monkeypatch.delenv(ENV, raising=False)
    for rank, launcher, line in (("0", None, f"raggedvl: loading model tiny and data {data} on 1 process...\n"),
                                 ("1", None, ""), ("0", '{"command_start": 0, "phases_s": {}}', "")):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("WORLD_SIZE", "1" if rank == "0" else "2")
        if launcher is not None:
            monkeypatch.setenv(ENV, launcher)
        assert main(argv) == 0
        assert capsys.readouterr().out == line, (rank, launcher)
    assert trained == ["tiny"] * 3


def test_a_count_of_one_is_worded_in_the_singular(tmp_path, capsys, small_data_cache):
    """``counted`` and the lines that print a count with it: a 1-step run says "training 1 step",
    its report's loss windows and the random ranker's row, a 2-step run's warmup warning."""
    from raggedvl.app.loop import train
    from raggedvl.app.report import chance_line, loss_windows
    from raggedvl.app.wording import counted

    assert [counted(n, "step") for n in (0, 1, 2)] == ["0 steps", "1 step", "2 steps"]
    assert [counted(n, "query", "queries") for n in (1, 3)] == ["1 query", "3 queries"]
    assert loss_windows([3.0, 1.0])[0] == "training loss: first 1 step 3.000 -> last 1 step 1.000"
    assert chance_line([], "late_interaction", 1) == "chance loss (every document scoring the same): ln(1 pair) = 0.000"
    cfg = TrainConfig(max_steps=1, warmup_steps=0, global_batch_size=4, max_train_samples=16, max_eval_samples=8,
                      eval_before=False, eval_after=False, output_dir=str(tmp_path / "run"), data_cache=str(small_data_cache))
    capsys.readouterr()
    train(cfg)
    out = capsys.readouterr().out
    assert "training 1 step, world size 1 (single process, cpu)" in out, out
    assert "steps 1," in out and "1 steps" not in out


def test_the_eta_of_an_absurd_step_count_is_printed_in_days_not_a_crash():
    assert eta_text(3725.4) == "1:02:05"
    assert eta_text(1e20) == f"{1e20 / 86400:.3g} days"  # beyond what a timedelta holds

"""Disks fill safely: a save that cannot fit is refused up front with the numbers, a write that
fails leaves no partial folder and never costs an older checkpoint, and the temporary folders of
killed writers are cleared at the next start."""

from __future__ import annotations

import shutil
from collections import namedtuple

import pytest
import torch

from raggedvl.app import checkpoint as ckpt
from raggedvl.app.checkpoint import (
    CheckpointContents,
    CheckpointError,
    check_free_space,
    list_checkpoints,
    remove_stale_temporaries,
    save_checkpoint,
)

Usage = namedtuple("Usage", "total used free")


def _save(root, step, **extra):
    contents = CheckpointContents(model_state={"w": torch.ones(1000)}, optimizer_state={"state": {}},
                                  rng_states=[{}], trainer_state={"step": step})
    return save_checkpoint(root, step, contents, **extra)


def _free(monkeypatch, free):
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda path: Usage(10**12, 0, free))


def test_a_save_that_cannot_fit_is_refused_with_the_numbers(tmp_path, monkeypatch):
    root = tmp_path / "checkpoints"
    first = _save(root, 5)
    size = ckpt.checkpoint_bytes(first)
    _free(monkeypatch, size - 1)
    with pytest.raises(CheckpointError) as info:
        check_free_space(root, 10, estimate_bytes=1)
    message = str(info.value)
    assert f"{size - 1:,} bytes free, {size:,} needed" in message and str(root) in message and "step 10" in message
    assert message.endswith("then --resume (older checkpoints are untouched)")
    _free(monkeypatch, size)
    check_free_space(root, 10, estimate_bytes=1)  # the newest checkpoint's size is the measure
    empty = tmp_path / "new"
    _free(monkeypatch, 999)
    with pytest.raises(CheckpointError, match="999 bytes free, 1,000 needed") as info:
        check_free_space(empty, 1, estimate_bytes=1000)  # no checkpoint yet: the estimate
    assert str(info.value).endswith("then start the run again (it has no checkpoint to resume)")


@pytest.mark.parametrize("error", [RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0"),
                                   OSError(28, "No space left on device")])
def test_a_failed_write_keeps_older_checkpoints_and_leaves_nothing(tmp_path, monkeypatch, error):
    root = tmp_path / "checkpoints"
    _save(root, 5)
    _save(root, 10)

    def full(*args, **kwargs):
        raise error

    monkeypatch.setattr(ckpt.torch, "save", full)
    with pytest.raises(CheckpointError, match="step 15 .* failed \\(no space left on the device"):
        _save(root, 15, keep=2)
    assert [p.name for p in root.iterdir()] and sorted(p.name for p in root.iterdir()) == ["step-000005", "step-000010"]


def test_stale_temporaries_of_killed_writers_are_removed(tmp_path):
    root = tmp_path / "checkpoints"
    kept = _save(root, 5)
    for name in ("step-000010.tmp-4431", "step-000005.old-77"):
        (root / name).mkdir()
        (root / name / "optimizer.pt").write_bytes(b"half")
    removed = remove_stale_temporaries(root)
    assert sorted(p.name for p in removed) == ["step-000005.old-77", "step-000010.tmp-4431"]
    assert list(root.iterdir()) == [kept]


@pytest.mark.slow
def test_a_run_stops_at_the_save_that_does_not_fit(tmp_path, monkeypatch, small_data_cache):
    """Room for the first checkpoint only: the second save stops the run with the numbers, the
    first checkpoint stays and no partial folder is left."""
    from raggedvl.app.config import TrainConfig
    from raggedvl.app.loop import train

    run = tmp_path / "run"
    real = shutil.disk_usage

    def usage(path):
        have = list_checkpoints(run / "checkpoints")
        return Usage(10**12, 0, 1000 if have else real(path).free)

    monkeypatch.setattr(ckpt.shutil, "disk_usage", usage)
    stale = run / "checkpoints" / "step-000002.tmp-12345"
    stale.mkdir(parents=True)
    cfg = TrainConfig(max_steps=4, global_batch_size=4, max_train_samples=8, eval_before=False, eval_after=False,
                      checkpoint_every=2, output_dir=str(run), data_cache=str(small_data_cache))
    with pytest.raises(CheckpointError, match=r"no space left for the checkpoint of step 4 .*: 1,000 bytes free"):
        train(cfg)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000002"]

"""A step whose gradient norm is not finite never reaches the weights: the optimizer and the
schedule skip it, metrics.jsonl marks it, --max-nonfinite-steps in a row stop the run with one
message, and no checkpoint holds a non-finite weight."""

from __future__ import annotations

import json
import math

import pytest
import torch

from raggedvl.app.checkpoint import checkpoint_weights, list_checkpoints
from raggedvl.app.config import TrainConfig
from raggedvl.app.loop import NonFiniteTraining, train

pytestmark = pytest.mark.slow  # tiny model, a few training steps


def _cfg(tmp_path, cache, **extra):
    settings = dict(max_steps=12, global_batch_size=4, warmup_steps=0, max_train_samples=16, eval_before=False,
                    eval_after=False, checkpoint_every=1, keep_checkpoints=20, log_every=100,
                    output_dir=str(tmp_path / "run"), data_cache=str(cache))
    return TrainConfig(**{**settings, **extra})


def _train_records(run):
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("event") == "train"]


def _all_finite(checkpoint):
    weights = checkpoint_weights(checkpoint)  # consolidated from the ranks' shards
    assert weights, f"no weights in {checkpoint}"
    return all(bool(torch.isfinite(t).all()) for t in weights.values())


def test_a_learning_rate_that_blows_up_stops_with_finite_checkpoints(tmp_path, small_data_cache):
    cfg = _cfg(tmp_path, small_data_cache, lr=1e3, head_lr=1e3, max_nonfinite_steps=2)
    with pytest.raises(NonFiniteTraining, match=r"2 steps in a row had a non-finite gradient .*\(--lr 1000\)"):
        train(cfg)
    records = _train_records(tmp_path / "run")
    bad = [r for r in records if r.get("nonfinite")]
    assert len(bad) == 2 and not math.isfinite(bad[-1]["grad_norm"])
    assert bad[1]["step"] == bad[0]["step"] + 1  # the stop came at the second in a row
    assert bad[0]["lr"] == bad[1]["lr"]  # the schedule did not advance over a skipped step
    checkpoints = list_checkpoints(tmp_path / "run" / "checkpoints")
    assert checkpoints and all(_all_finite(c) for c in checkpoints)
    assert max(int(c.name.split("-")[1]) for c in checkpoints) < bad[-1]["step"]  # the stopping step saves nothing


def test_a_skipped_step_leaves_the_weights_and_the_schedule_alone(tmp_path, small_data_cache):
    """A temperature so small that every score overflows: no step is applied, so the weights after
    the stop equal the initial weights bit for bit."""
    from raggedvl.app.loop import Trainer
    from raggedvl.parallel import init_distributed

    cfg = _cfg(tmp_path, small_data_cache, temperature=1e-30, max_steps=2, checkpoint_every=100)
    trainer = Trainer(cfg, init_distributed())
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    lr = trainer.scheduler.get_last_lr()
    batches = trainer.batch_stream()
    result = trainer.train_step(next(batches))
    assert not result.applied and not math.isfinite(result.grad_norm)
    after = trainer.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert trainer.scheduler.get_last_lr() == lr


@pytest.mark.dist
def test_two_processes_skip_alike_and_stop_together(tmp_path, small_data_cache):
    """The verdict comes from the norm of the averaged gradient, the same on every rank: both
    skip the same steps and stop at the same one, with one line and no hang."""
    import os
    import subprocess
    import sys

    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "raggedvl.app.cli", "train", "--lr", "1000", "--head-lr", "1000", "--max-nonfinite-steps",
           "2", "--max-steps", "12", "--global-batch-size", "4", "--warmup-steps", "0", "--max-train-samples", "16",
           "--eval-before", "false", "--eval-after", "false", "--checkpoint-every", "1", "--nproc-per-node", "2",
           "--output-dir", str(run), "--data-cache", str(small_data_cache)]
    done = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=600)
    output = done.stdout + done.stderr
    assert done.returncode != 0, output[-3000:]
    assert "NonFiniteTraining: 2 steps in a row had a non-finite gradient" in output, output[-3000:]
    bad = [r["step"] for r in _train_records(run) if r.get("nonfinite")]
    assert len(bad) == 2 and bad[1] == bad[0] + 1, bad
    assert all(_all_finite(c) for c in list_checkpoints(run / "checkpoints"))

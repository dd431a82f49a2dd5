"""`raggedvl train` under torchrun (2 gloo processes): a rank killed mid-run, then `--resume`,
gives the same per-step losses as an uninterrupted run."""

import json
import os
import sys

import pytest

from tests.jobs import TRAIN_READY, run_job

pytestmark = [pytest.mark.dist, pytest.mark.slow]

COMMON = [
    "--max-steps", "6", "--checkpoint-every", "2", "--max-train-samples", "16", "--max-eval-samples", "8",
    "--global-batch-size", "4", "--eval-before", "false", "--eval-after", "false", "--log-every", "1",
    "--data-workers", "1",  # a worker collates ahead: the checkpoint must hold the trained batch's position
]


def _train(run_dir, cache, *extra, fault=None, timeout=240):
    """One `raggedvl train` job; ``timeout`` seconds from the end of its start-up (tests/jobs.py)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("RAGGEDVL_FAULT", None)
    if fault:
        env["RAGGEDVL_FAULT"] = fault
    cmd = [sys.executable, "-m", "raggedvl.app.cli", "train", *COMMON, "--output-dir", str(run_dir), "--data-cache", str(cache), *extra]
    return run_job(cmd, env=env, ready=TRAIN_READY, timeout=timeout)


def _logged(run_dir, key="loss"):
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("event") == "train":
            out[rec["step"]] = rec[key]
    return out


def _losses(run_dir):
    return _logged(run_dir, "loss")


def _expected_lrs(steps=6, lr=2e-4):
    """transformers' cosine-with-warmup with the default warmup of a run of ``steps``
    (raggedvl.app.config.default_warmup_steps); the log holds the learning rate each step used,
    read before its scheduler.step() (0 at step 1)."""
    import torch
    from transformers import get_cosine_schedule_with_warmup

    from raggedvl.app.config import default_warmup_steps

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    sched = get_cosine_schedule_with_warmup(opt, default_warmup_steps(steps), steps)
    out = {}
    for step in range(1, steps + 1):
        out[step] = sched.get_last_lr()[0]
        opt.step()
        sched.step()
    return out


def test_kill_one_rank_then_resume_gives_the_same_losses(tmp_path, small_data_cache):
    cache = small_data_cache
    full = _train(tmp_path / "full", cache)
    assert full.returncode == 0, full.stderr[-3000:]
    reference = _losses(tmp_path / "full")
    assert sorted(reference) == [1, 2, 3, 4, 5, 6]
    assert _logged(tmp_path / "full", "lr") == pytest.approx(_expected_lrs(), rel=1e-12)

    killed = _train(tmp_path / "resumed", cache, fault="kill:1:5")  # rank 1 dies at the start of step 6
    assert killed.returncode != 0
    assert "rank" in (killed.stderr + killed.stdout).lower()
    ckpts = sorted(p.name for p in (tmp_path / "resumed" / "checkpoints").iterdir())
    assert ckpts == ["step-000002", "step-000004"], ckpts

    resumed = _train(tmp_path / "resumed", cache, "--resume", "true")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout + resumed.stderr
    got = _losses(tmp_path / "resumed")
    assert sorted(got) == [1, 2, 3, 4, 5, 6]  # each step logged exactly once
    for step in range(1, 7):
        assert got[step] == pytest.approx(reference[step], rel=1e-6, abs=1e-7), (step, got, reference)
    assert _logged(tmp_path / "resumed", "lr") == _logged(tmp_path / "full", "lr")  # the schedule resumes exactly
    summary = (tmp_path / "resumed" / "summary.md").read_text()  # the loss windows span the whole run
    assert "first 3 steps" in summary and "(logged steps 1-6 of metrics.jsonl; resumed at step 4)" in summary

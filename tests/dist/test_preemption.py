"""Preemption: SIGTERM (a cluster's scancel, Kubernetes) or SIGUSR1 (SLURM's --signal) on any
process of the job: the step completes on every rank, a checkpoint of it is written, one line
says where, the command exits 3, and --resume continues with the per-step losses of the
uninterrupted run, bit for bit (same process count and strategy on the same machine: the same
operations in the same order, resume restores weights, optimizer, sampler and RNG exactly)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = [pytest.mark.dist, pytest.mark.slow]

STEPS = 8
TIMEOUT_S = 600  # a hang, not a slow start, on a loaded 2-core machine


def _cmd(run_dir, cache, nproc, *extra):
    return [sys.executable, "-m", "raggedvl.app.cli", "train", "--max-steps", str(STEPS), "--warmup-steps", "1",
            "--global-batch-size", "4", "--max-train-samples", "16", "--eval-before", "false", "--eval-after", "false",
            "--checkpoint-every", "100", "--log-every", "1", "--nproc-per-node", str(nproc), "--output-dir",
            str(run_dir), "--data-cache", str(cache), *extra]


def _run(cmd, **env):
    done = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1", **env), capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    return done.returncode, done.stdout + done.stderr


def _losses(run_dir):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r.get("event") == "train"}


def _preempted_then_resumed(tmp_path, cache, nproc, *extra, fault=None, signal_launcher=False):
    straight = tmp_path / "straight"
    code, out = _run(_cmd(straight, cache, nproc, *extra))
    assert code == 0, out[-3000:]
    run = tmp_path / "run"
    if signal_launcher:  # SIGTERM to the launching process (the agent) once step 2 is logged
        proc = subprocess.Popen(_cmd(run, cache, nproc, *extra), env=dict(os.environ, OMP_NUM_THREADS="1"),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.time() + TIMEOUT_S
        while time.time() < deadline and proc.poll() is None:
            metrics = run / "metrics.jsonl"
            if metrics.exists() and '"step": 2,' in metrics.read_text():
                proc.send_signal(signal.SIGTERM)
                break
            time.sleep(0.05)
        out, _ = proc.communicate(timeout=TIMEOUT_S)
        code = proc.returncode
    else:
        code, out = _run(_cmd(run, cache, nproc, *extra), RAGGEDVL_FAULT=fault)
    assert code == 3, out[-3000:]
    (line,) = [x for x in out.splitlines() if x.startswith("raggedvl: preempted at step")]
    stopped = int(line.split("preempted at step ")[1].split()[0])
    assert f"checkpoint: {run / 'checkpoints' / f'step-{stopped:06d}'}; resume with --resume" in line, line
    assert stopped < STEPS, line
    code, out = _run(_cmd(run, cache, nproc, *extra, "--resume"))
    assert code == 0, out[-3000:]
    expected, got = _losses(straight), _losses(run)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert [got[s] for s in range(1, STEPS + 1)] == [expected[s] for s in range(1, STEPS + 1)]
    return stopped


def test_sigterm_in_one_process_saves_that_step_and_resumes_exactly(tmp_path, small_data_cache):
    stopped = _preempted_then_resumed(tmp_path, small_data_cache, 1, fault="term:0:3")
    assert stopped == 4  # the signal came at the start of step 4: that step completes and is saved


def test_sigterm_on_one_rank_stops_both_after_the_same_step(tmp_path, small_data_cache):
    stopped = _preempted_then_resumed(tmp_path, small_data_cache, 2, fault="term:1:2")
    assert stopped == 3


def test_sigterm_under_fsdp2(tmp_path, small_data_cache):
    assert _preempted_then_resumed(tmp_path, small_data_cache, 2, "--strategy", "fsdp2", fault="term:0:4") == 5


def test_sigterm_to_the_launcher_is_passed_to_the_ranks(tmp_path, small_data_cache):
    assert _preempted_then_resumed(tmp_path, small_data_cache, 2, signal_launcher=True) >= 2


def test_past_the_grace_period_nothing_is_saved_and_the_line_says_so(tmp_path, small_data_cache):
    run = tmp_path / "run"
    code, out = _run(_cmd(run, small_data_cache, 1, "--preemption-grace-s", "1e-9"), RAGGEDVL_FAULT="term:0:2")
    assert code == 3, out[-3000:]
    assert "raggedvl: preempted at step 3 (SIGTERM after" in out and "not saved" in out and "last checkpoint: none" in out
    assert not (run / "checkpoints").exists() or not any((run / "checkpoints").iterdir())


def test_a_torchrun_restart_resumes_by_itself_and_says_why(tmp_path, small_data_cache):
    """--max-restarts 1 and rank 1 killed at the start of step 5: torchrun restarts the group,
    which resumes from the step-4 checkpoint without --resume, says which restart it is and that
    rank 1 was killed without a report, and ends with the uninterrupted run's per-step losses."""
    straight = tmp_path / "straight"
    code, out = _run(_cmd(straight, small_data_cache, 2, "--checkpoint-every", "2"))
    assert code == 0, out[-3000:]
    run = tmp_path / "run"
    code, out = _run(_cmd(run, small_data_cache, 2, "--checkpoint-every", "2", "--max-restarts", "1"),
                     RAGGEDVL_FAULT="kill:1:4")
    assert code == 0, out[-3000:]
    (line,) = [x for x in out.splitlines() if x.startswith("raggedvl: restart ")]
    # the cause first, whether or not rank 0 reported its broken collective before torchrun stopped it
    assert line.startswith("raggedvl: restart 1 of 1 after: local rank 1 was killed by SIGKILL (it left no report)"), line
    assert line.endswith(f"resuming from {run / 'checkpoints' / 'step-000004'}"), line
    expected, got = _losses(straight), _losses(run)
    assert [got[s] for s in range(1, STEPS + 1)] == [expected[s] for s in range(1, STEPS + 1)]

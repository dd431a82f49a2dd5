"""Ctrl-C in `raggedvl train`: one line naming the step and the checkpoint to resume
from, exit code 130, no traceback from any rank or from torchrun's agent, no rank left behind.

The job runs in its own session as a terminal's foreground job would; once `metrics.jsonl`
shows trained steps (and, where checkpoints are written every step, a checkpoint), SIGINT goes
to its whole process group, as Ctrl-C sends it: with one process that is the training loop
itself, with two it is torchrun's agent (raggedvl.app.agent), which passes it on to the
ranks; a second SIGINT half a second later (an impatient Ctrl-C) changes nothing. Bounds (tests/jobs.py): start-up until the ready line is not counted; 240 s x the
measured slowdown from then to the end, so a hang fails the test and a slow machine does not.
"""

import json
import os
import re
import signal
import sys
import time

import pytest

from raggedvl.app.checkpoint import list_checkpoints
from tests.jobs import TRAIN_READY, Job, processes_mentioning

pytestmark = [pytest.mark.dist, pytest.mark.slow]

SMALL = dict(max_steps=100_000, max_train_samples=16, max_eval_samples=8, global_batch_size=4, eval_before=False,
             eval_after=False, log_every=1)
LINE = re.compile(r"^raggedvl: interrupted at step (\d+); last checkpoint: (.+?)(; resume with --resume)?$", re.MULTILINE)


def _cli_args(cfg: dict) -> list[str]:
    return [a for k, v in cfg.items() for a in ("--" + k.replace("_", "-"), str(v).lower() if isinstance(v, bool) else str(v))]


def _logged_steps(run_dir) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    steps = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:  # a line being written
            continue
        if record.get("event") == "train":
            steps.append(record["step"])
    return steps


@pytest.mark.parametrize("nproc, checkpoint_every", [(1, 100_000), (2, 1)], ids=["1-process-no-checkpoint", "2-processes"])
def test_ctrl_c_ends_the_job_with_one_line_and_exit_code_130(small_data_cache, tmp_path, nproc, checkpoint_every):
    run = tmp_path / "run"
    args = _cli_args({**SMALL, "checkpoint_every": checkpoint_every, "nproc_per_node": nproc, "output_dir": run,
                      "data_cache": small_data_cache})
    job = Job([sys.executable, "-m", "raggedvl.app.cli", "train", *args], ready=TRAIN_READY, timeout=240,
              env=dict(os.environ, OMP_NUM_THREADS="1"))
    while True:  # a few trained steps, and the checkpoint they wrote
        result = job.poll()
        assert result is None, f"the job ended before it was interrupted\n{result.describe()}"
        if len(_logged_steps(run)) >= 2 and (checkpoint_every > 1 or list_checkpoints(run / "checkpoints")):
            break
        time.sleep(0.3)
    sent = time.time()
    os.killpg(job.proc.pid, signal.SIGINT)  # Ctrl-C: the whole foreground process group
    time.sleep(0.5)
    try:  # an impatient second Ctrl-C while the job shuts down: ignored
        os.killpg(job.proc.pid, signal.SIGINT)
    except ProcessLookupError:  # already over
        pass
    result = job.wait()
    print(f"{nproc} process(es): exit code {result.returncode} {result.ended_at - sent:.1f} s after SIGINT "
          f"(slowdown {result.slowdown:.1f})")
    assert result.timed_out is None, result.describe()
    assert result.returncode == 130, result.describe()
    out = result.output
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, result.describe()
    assert "error_file" not in out and "ChildFailedError" not in out and "stopped by" not in out, result.describe()
    assert out.count("interrupted at step") == 1 and "failed in step" not in out, result.describe()
    line = LINE.search(result.stderr)
    assert line, result.describe()
    logged = _logged_steps(run)
    assert logged[-1] <= int(line.group(1)) <= logged[-1] + 1  # the steps done when the signal came
    checkpoints = list_checkpoints(run / "checkpoints")
    if checkpoint_every == 1:  # the newest checkpoint, and how to continue from it
        assert line.group(2) == str(checkpoints[0]) and line.group(3), line.group(0)
    else:  # nothing to resume from: no advice to
        assert checkpoints == [] and line.group(2) == "none" and not line.group(3), line.group(0)
    assert processes_mentioning(str(run)) == []  # no rank outlives the job

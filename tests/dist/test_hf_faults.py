"""``RaggedTrainer`` never hangs silently: a process that stalls or raises ends the
torchrun job within the collective timeout, with ``raggedvl:`` lines naming the process and the
step it was in, exactly as ``raggedvl train`` does (``tests/dist/test_fault_matrix.py``).

Two 2-process torchrun jobs of ``tests/dist/hf_fault_job.py`` run at once; ``RAGGEDVL_FAULT``
makes process 1 hang (sleep forever) or raise at the start of step 2. The group was created by
accelerate with ``ddp_timeout`` = 1800 s; ``collective_timeout_s`` = 20 s must bound it.
"""

import os
import re
import sys
from pathlib import Path

import pytest

from tests.dist.hf_fault_job import READY
from tests.jobs import processes_mentioning, run_jobs

pytestmark = [pytest.mark.dist, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 20
# torchrun noticing the failure, stopping the other process and tearing down interpreters: up to
# ~25 s on a loaded 2-core machine (CPU work: x the measured slowdown); still far below
# accelerate's own 1800 s group timeout
SLACK_S = 60
SCENARIOS = {"hangs": "hang:1:1", "raises": "raise:1:1"}
FAULT_LINE = re.compile(r"RAGGEDVL_FAULT=\S+: rank 1 will (\w+) in step 2 at unix time ([0-9.]+)")


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """name -> (return code, output, end time, output dir, slowdown); both jobs run concurrently,
    each with 300 s from the moment both its processes built the trainer (tests/jobs.py)."""
    root = tmp_path_factory.mktemp("hf-faults")
    commands = {
        name: ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                "-m", "tests.dist.hf_fault_job", str(TIMEOUT_S), str(root / name)],
               dict(os.environ, OMP_NUM_THREADS="1", RAGGEDVL_FAULT=fault, PYTHONPATH=str(ROOT)))
        for name, fault in SCENARIOS.items()
    }
    return run_jobs(commands, root, ready=READY, timeout=300, cwd=ROOT)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_the_job_ends_within_the_timeout_and_names_the_failing_process(jobs, name):
    rc, out, end, out_dir, slow = jobs[name]
    assert rc != 0, out[-3000:]
    injected = FAULT_LINE.search(out)
    assert injected and injected.group(1) == SCENARIOS[name].split(":")[0], out[-3000:]
    took = end - float(injected.group(2))
    print(f"{name}: exit code {rc}, job over {took:.1f} s after the fault (timeout {TIMEOUT_S} s, slowdown {slow:.1f})")
    assert 0 < took <= TIMEOUT_S + SLACK_S * slow, (took, slow, out[-3000:])
    assert processes_mentioning(str(out_dir)) == []  # no process outlives the job
    if name == "raises":
        assert "raggedvl: rank 1 failed in step 2: RuntimeError: injected fault on rank 1" in out, out[-3000:]
        assert "Timed out" not in out, out[-3000:]  # the peer fails as soon as the group is aborted
        return
    assert "raggedvl: rank 1 has spent" in out and "in inject_fault" in out, out[-3000:]  # with its stack
    report = re.search(r"raggedvl: rank 0 failed in step 2: .*\n"
                       r"raggedvl:   rank 1 reported [0-9.]+ s earlier: rank 1 has spent [0-9]+ s in step 2", out)
    assert report and "Timed out" in report.group(0), out[-3000:]
    assert took >= TIMEOUT_S  # the peer waited the collective timeout, not accelerate's 1800 s

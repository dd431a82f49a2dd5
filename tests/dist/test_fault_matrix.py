"""Fault matrix: one rank of a 2-rank training job raises, is killed or
hangs, and the whole job ends within the collective timeout with output that names that rank.

`raggedvl train` starts torchrun's agent (raggedvl.app.agent) with 2 gloo processes; `RAGGEDVL_FAULT=KIND:RANK:2` makes one
rank fail at the start of step 3 and print the moment it does. The four jobs run concurrently
(the costly part is starting them; each check is measured from its own fault, not from the
launch). A second test runs the training loop on the plain test harness (one gloo group, no
torchrun agent to tear anything down) and checks that the peer blocked in a collective fails
fast with an error that names the failing rank.
"""

import os
import re
import sys
import time

import pytest

from raggedvl.app.config import TrainConfig
from tests.dist.harness import rank_slowdown, run_distributed
from tests.jobs import TRAIN_READY, processes_mentioning, run_jobs

pytestmark = [pytest.mark.dist, pytest.mark.slow]

TIMEOUT_S = 20  # --collective-timeout-s
SLACK_S = 25  # torchrun noticing the failure and stopping the others (CPU work: x the measured slowdown)
SMALL = dict(max_steps=4, max_train_samples=16, max_eval_samples=8, global_batch_size=4,
             eval_before=False, eval_after=False)
SCENARIOS = {  # name: (RAGGEDVL_FAULT, failing rank)
    "rank1-raises": ("raise:1:2", 1),
    "rank1-killed": ("kill:1:2", 1),
    "rank1-hangs": ("hang:1:2", 1),
    "rank0-raises": ("raise:0:2", 0),
}
FAULT_LINE = re.compile(r"RAGGEDVL_FAULT=\S+: rank (\d) will (\w+) in step 3 at unix time ([0-9.]+)")


def _cli_args(cfg: dict) -> list[str]:
    return [a for k, v in cfg.items() for a in ("--" + k.replace("_", "-"), str(v).lower() if isinstance(v, bool) else str(v))]


@pytest.fixture(scope="module")
def data_cache(small_data_cache):
    return small_data_cache  # built once per session, before any rank starts (tests/conftest.py)


@pytest.fixture(scope="module")
def jobs(data_cache, tmp_path_factory):
    """Start every scenario at once; return name -> (return code, output, end time, run dir,
    slowdown measured while it ran).
    Each job gets 240 s from the end of its start-up (tests/jobs.py: start-up on a loaded
    machine is not counted; a job past the bound is killed with its ranks and fails its test)."""
    root = tmp_path_factory.mktemp("fault-runs")
    commands = {}
    for name, (fault, _) in SCENARIOS.items():
        args = _cli_args({**SMALL, "collective_timeout_s": TIMEOUT_S, "output_dir": root / name, "data_cache": data_cache})
        commands[name] = ([sys.executable, "-m", "raggedvl.app.cli", "train", *args],
                          dict(os.environ, OMP_NUM_THREADS="1", RAGGEDVL_FAULT=fault))
    return run_jobs(commands, root, ready=TRAIN_READY, timeout=240)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_the_job_ends_within_the_timeout_and_names_the_failing_rank(jobs, name):
    fault, bad = SCENARIOS[name]
    kind = fault.split(":")[0]
    peer = 1 - bad
    rc, out, end, run_dir, slow = jobs[name]
    assert rc != 0, out[-3000:]
    injected = FAULT_LINE.search(out)
    assert injected and int(injected.group(1)) == bad and injected.group(2) == kind, out[-3000:]
    took = end - float(injected.group(3))
    print(f"{name}: exit code {rc}, job over {took:.1f} s after the fault (timeout {TIMEOUT_S} s, slowdown {slow:.1f})")
    assert 0 < took <= TIMEOUT_S + SLACK_S * slow, (took, slow, out[-3000:])
    if kind != "hang":  # nothing waits for the timeout: the peer fails as soon as the rank is gone
        assert "Timed out" not in out, out[-3000:]
    assert processes_mentioning(str(run_dir)) == []  # no rank outlives the job

    # raggedvl's agent prints one failure line for the whole job, and no torchrun wrapper block
    assert "ChildFailedError" not in out and "error_file" not in out and "Traceback" not in out, out[-3000:]
    failures = [line for line in out.splitlines()
                if re.match(r"raggedvl: rank \d (failed|was killed)", line) or "; then rank " in line]
    assert len(failures) == 1, out[-3000:]
    if kind == "raise":
        assert failures[0].startswith(f"raggedvl: rank {bad} failed in step 3: RuntimeError: injected fault on rank {bad}")
        assert "(traceback: " in failures[0]  # the rank's error file keeps its traceback
    elif kind == "kill":  # a SIGKILLed rank leaves no note: the agent names it and the signal
        assert failures[0].startswith(f"raggedvl: rank {bad} was killed by SIGKILL (it left no report"), failures[0]
    else:  # the stalled rank warns with its stack; the job's line leads with its note, then the peer that timed out
        assert f"raggedvl: rank {bad} has spent" in out and "in inject_fault" in out, out[-3000:]
        assert re.match(rf"raggedvl: rank {bad} has spent \d+ s in step 3 .*; then rank {peer} failed in step 3: .*Timed out",
                        failures[0]), failures[0]
        assert took >= TIMEOUT_S  # the peer waited the full timeout, not longer than the bound


def _train_with_fault(rank, world_size, run_dir, cache):
    from raggedvl.app.loop import train

    os.environ["RAGGEDVL_FAULT"] = "raise:1:2"
    try:
        train(TrainConfig(**SMALL, output_dir=str(run_dir), data_cache=str(cache)))
    except Exception as exc:  # noqa: BLE001 - the error and its notes are the result
        return {"failed_at": time.time(), "error": f"{type(exc).__name__}: {exc}", "notes": list(exc.__notes__),
                "slowdown": rank_slowdown()}
    return {"failed_at": None, "error": None, "notes": [], "slowdown": rank_slowdown()}


def test_without_torchrun_the_peer_fails_fast_and_names_the_failing_rank(data_cache, tmp_path):
    group_timeout = 90  # the harness's group timeout; the peer must not need it
    r0, r1 = run_distributed(_train_with_fault, 2, tmp_path / "run", data_cache, timeout=group_timeout)
    assert r1["error"].startswith("RuntimeError: injected fault on rank 1 in step 3")
    assert r1["notes"] == ["raggedvl: rank 1 failed in step 3: RuntimeError: " + r1["error"].split(": ", 1)[1]]
    assert r0["error"] is not None and "injected" not in r0["error"]  # rank 0 failed in its collective
    note = "\n".join(r0["notes"])
    assert note.startswith("raggedvl: rank 0 failed in step 3: RuntimeError:"), note
    assert re.search(r"raggedvl:   rank 1 reported [0-9.]+ s earlier: rank 1 failed in step 3: "
                     r"RuntimeError: injected fault on rank 1", note), note
    # aborted group: no wait for the group timeout (90 s x the slowdown); 15 s of CPU work x the slowdown
    assert 0 <= r0["failed_at"] - r1["failed_at"] < 15 * r0["slowdown"], (r0["failed_at"] - r1["failed_at"], r0["slowdown"])

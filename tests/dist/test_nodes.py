"""Two (or three) `raggedvl train` launchers on 127.0.0.1, one process each, as the nodes of one
job (`--nnodes N --node-rank I --rdzv-endpoint 127.0.0.1:PORT`, torchrun's static rendezvous):

- the job trains like one node with 2 processes: the same per-step losses, bit for bit (the same
  operations in the same order; only the transport of the same gloo all-reduces differs);
- node 1's launcher SIGKILLed: its rank ends with it, and node 0's one line names rank 1 on node
  1, with its pid, as the rank that stopped responding, before rank 0's own connection error;
- rank 1 frozen (SIGSTOP): node 0's one line names rank 1 on node 1 at the collective timeout,
  and rank 0, which only waited, is never reported as the one that stalled;
- a node that does not join: node 0 says how many joined at each interval (shortened here with
  RAGGEDVL_WAITING_INTERVAL_S), stops at `--rdzv-conf join_timeout=` with one line, and stops at
  once on Ctrl-C with one line.

Robust on a loaded machine: ports come from the kernel (bind to port 0), every bound is a hang
bound (generous), no duration is asserted, and every process of a test (launchers, agents and
ranks, found by the test's own directory in their command lines) is SIGKILLed when it ends.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import sys
import time

import pytest

from tests.jobs import Job, processes_mentioning

pytestmark = [pytest.mark.dist, pytest.mark.slow]

HANG_S = 600  # a hang, not a slow start, on a loaded 2-core machine
COLLECTIVE_TIMEOUT_S = 30  # a frozen peer is detected at half of it and the job ends at it


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train(out, cache, *extra):
    return [sys.executable, "-m", "raggedvl.app.cli", "train", "--warmup-steps", "1", "--global-batch-size", "4",
            "--max-train-samples", "16", "--eval-before", "false", "--eval-after", "false", "--checkpoint-every", "100",
            "--log-every", "1", "--data-cache", str(cache), "--output-dir", str(out), *extra]


def _node(tmp_path, cache, rank, port, *extra, nnodes=2, env=None):
    """Start node ``rank``'s launcher (one process) and return its job."""
    cmd = _train(tmp_path / f"node{rank}", cache, "--nproc-per-node", "1", "--nnodes", str(nnodes), "--node-rank",
                 str(rank), "--rdzv-endpoint", f"127.0.0.1:{port}", *extra)
    return Job(cmd, ready=None, timeout=HANG_S, merged=True, env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})))


def _kill_everything(tmp_path) -> None:
    """SIGKILL every process whose command line mentions this test's directory (stopped ones too)."""
    for line in processes_mentioning(str(tmp_path)):
        try:
            os.kill(int(line.split(":", 1)[0]), signal.SIGKILL)
        except ProcessLookupError:
            pass


def _wait_for(condition, what: str):
    deadline = time.monotonic() + HANG_S
    while time.monotonic() < deadline:
        if (value := condition()):
            return value
        time.sleep(0.2)
    raise AssertionError(f"no {what} within {HANG_S} s")


def _children(pid: int) -> list[int]:
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry))
        except OSError:
            continue
    return found


def _losses(run_dir) -> dict[int, float]:
    path = run_dir / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return {r["step"]: r["loss"] for r in records if r.get("event") == "train"}


def _stepped(run_dir) -> bool:
    """Whether rank 0 logged its first step (read as text: the line being written may be partial)."""
    path = run_dir / "metrics.jsonl"
    return path.exists() and any(x.startswith('{"event": "train", "step": 1,') for x in path.read_text().splitlines())


def _finished(job):
    result = _wait_for(job.poll, "end of the launcher")
    assert not result.timed_out, result.describe()
    return result


def _both_training(tmp_path, cache, *extra):
    """Nodes 0 and 1 started and past their first step; returns (node 0's job, node 1's job,
    the pid of node 1's rank)."""
    port = _free_port()
    jobs = [_node(tmp_path, cache, rank, port, *extra) for rank in (0, 1)]
    _wait_for(lambda: _stepped(tmp_path / "node0") or any(j.poll() for j in jobs), "first step")
    assert all(j.poll() is None for j in jobs), [j.poll().describe() for j in jobs if j.poll()]
    (worker,) = _children(jobs[1].proc.pid)  # node 1's agent has the same pid as its launcher (exec)
    return jobs[0], jobs[1], worker


def _job_line(output: str) -> str:
    lines = [x for x in output.splitlines() if "; then rank 0 failed in step " in x]
    assert len(lines) == 1, output[-3000:]
    return lines[0]


def test_two_launchers_train_like_one_node_with_two_processes(tmp_path, small_data_cache):
    one = Job(_train(tmp_path / "one", small_data_cache, "--max-steps", "2", "--nproc-per-node", "2"), ready=None,
              timeout=HANG_S, merged=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        result = _finished(one)
        assert result.returncode == 0, result.describe()
        port = _free_port()
        nodes = [_node(tmp_path, small_data_cache, rank, port, "--max-steps", "2") for rank in (0, 1)]
        for node in nodes:
            result = _finished(node)
            assert result.returncode == 0, result.describe()
        assert "world size 2" in nodes[0].result.output
        expected = _losses(tmp_path / "one")
        assert sorted(expected) == [1, 2]
        assert _losses(tmp_path / "node0") == expected
    finally:
        _kill_everything(tmp_path)


def test_a_lost_node_is_named_by_the_node_that_remains(tmp_path, small_data_cache):
    node0, node1, worker = _both_training(tmp_path, small_data_cache, "--max-steps", "100000",
                                          "--collective-timeout-s", str(COLLECTIVE_TIMEOUT_S))
    try:
        os.kill(node1.proc.pid, signal.SIGKILL)  # node 1's launcher, i.e. its torchrun agent
        result = _finished(node0)
        assert result.returncode == 1, result.describe()
        line = _job_line(result.output)
        assert re.match(rf"raggedvl: rank 1 \(node 1, host [^,]+, pid {worker}\) stopped responding: no heartbeat for "
                        r"\d+ s \(killed, frozen, or its node lost\); then rank 0 failed in step \d+: ", line), line
        assert "Traceback" not in result.output, result.output[-3000:]
        _wait_for(lambda: not os.path.exists(f"/proc/{worker}"), "end of the orphaned rank")  # no rank outlives its agent
        assert f"raggedvl: rank 1: the torchrun agent that started it (pid {node1.proc.pid}) is gone" in \
            _finished(node1).output
    finally:
        _kill_everything(tmp_path)


def test_a_frozen_rank_is_named_and_the_rank_waiting_for_it_is_not(tmp_path, small_data_cache):
    node0, node1, worker = _both_training(tmp_path, small_data_cache, "--max-steps", "100000",
                                          "--collective-timeout-s", str(COLLECTIVE_TIMEOUT_S))
    try:
        os.kill(worker, signal.SIGSTOP)
        result = _finished(node0)
        assert result.returncode == 1, result.describe()
        line = _job_line(result.output)
        assert re.match(rf"raggedvl: rank 1 \(node 1, host [^,]+, pid {worker}\) stopped responding: .*; then rank 0 "
                        r"failed in step \d+: .*Timed out", line), line
        assert "rank 0 has spent" not in result.output, result.output[-3000:]  # the waiting rank is not the stalled one
        assert re.search(rf"raggedvl: rank 0 has waited \d+ s in step \d+ for rank 1 \(node 1, host [^,]+, pid {worker}\), "
                         "which stopped responding", result.output), result.output[-3000:]
    finally:
        _kill_everything(tmp_path)


def test_a_node_that_does_not_join_is_waited_for_until_the_join_timeout(tmp_path, small_data_cache):
    port = _free_port()
    node0 = _node(tmp_path, small_data_cache, 0, port, "--max-steps", "2", "--rdzv-conf", "join_timeout=10",
                  env={"RAGGEDVL_WAITING_INTERVAL_S": "1"})
    try:
        result = _finished(node0)
        waiting = f"raggedvl: waiting for nodes: 1 of 2 joined (rdzv 127.0.0.1:{port}, timeout 10 s)"
        assert result.returncode == 1 and result.output.count(waiting) >= 2, result.describe()
        assert result.output.rstrip().splitlines()[-1].startswith(
            f"raggedvl: the nodes did not join within the join timeout: 1 of 2 joined (rdzv 127.0.0.1:{port}, "
            "timeout 10 s); start the same command on every node"), result.describe()
        assert "Traceback" not in result.output and "DistStoreError" not in result.output, result.describe()
    finally:
        _kill_everything(tmp_path)


def test_ctrl_c_stops_the_wait_for_nodes_with_one_line(tmp_path, small_data_cache):
    """Three nodes expected, two started: node 0 counts both, then Ctrl-C ends it."""
    port = _free_port()
    env = {"RAGGEDVL_WAITING_INTERVAL_S": "1"}
    nodes = [_node(tmp_path, small_data_cache, rank, port, "--max-steps", "2", nnodes=3, env=env) for rank in (0, 1)]
    try:
        waiting = f"raggedvl: waiting for nodes: 2 of 3 joined (rdzv 127.0.0.1:{port}, timeout 900 s)"
        _wait_for(lambda: nodes[0].poll() or waiting in "".join(nodes[0]._read()), "line counting both nodes")
        assert nodes[0].poll() is None, nodes[0].poll().describe()
        nodes[0].proc.send_signal(signal.SIGINT)
        result = _finished(nodes[0])
        assert result.returncode == 130, result.describe()
        last = result.output.rstrip().splitlines()[-1]
        assert last == f"raggedvl: stopped by Ctrl-C while waiting for nodes: 2 of 3 joined (rdzv 127.0.0.1:{port}, " \
            "timeout 900 s)", result.describe()
        assert "Traceback" not in result.output and "KeyboardInterrupt" not in result.output, result.describe()
    finally:
        _kill_everything(tmp_path)

"""raggedvl.app.agent: what a failing rank records in torchrun's error file, read back by
torchrun's own ``ProcessFailure``, and which single line the agent prints for a failed job.
(End to end through ``raggedvl train``: tests/dist/test_fault_matrix.py.)"""

import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from raggedvl.app.agent import as_input_error, first_failure, record_failure
from raggedvl.parallel.faults import report_failure


def _failure(tmp_path, monkeypatch, rank, exc, *, exit_code, exitcode=1) -> ProcessFailure:
    path = tmp_path / f"error-{rank}.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    monkeypatch.setenv("RANK", str(rank))
    assert record_failure(exc, exit_code=exit_code)
    return ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=exitcode, error_file=str(path))


def test_record_failure_without_an_error_file_does_nothing(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    assert record_failure(ValueError("x"), exit_code=2) is False


def test_an_input_error_is_its_own_line_with_exit_code_2(tmp_path, monkeypatch):
    exc = ValueError("eval_dataset 'x' has no split 'dev'\n(the splits present: train)")
    failures = {0: _failure(tmp_path, monkeypatch, 0, exc, exit_code=2, exitcode=2)}
    assert failures[0].message["message"].startswith("ValueError: eval_dataset")  # torchrun's own reading
    line, code = first_failure(failures)
    assert (line, code) == ("rank 0: ValueError: eval_dataset 'x' has no split 'dev'", 2)


def test_an_input_error_found_while_setting_up_reads_as_the_launchers(tmp_path, monkeypatch):
    """A rank's ValueError during setup (bad input every rank reads alike): the agent's line is
    ``error: <message>``, without "rank 1 failed during setup"; a follower's report is kept."""
    exc = ValueError("evaluation set 'pairs.parquet' (split 'train') overlaps the training pairs:\n3 of 8 ...")
    report_failure(1, "during setup", exc)
    as_input_error(exc)
    line, code = first_failure({1: _failure(tmp_path, monkeypatch, 1, exc, exit_code=2, exitcode=2)})
    assert (line, code) == ("error: evaluation set 'pairs.parquet' (split 'train') overlaps the training pairs: "
                            "3 of 8 ...", 2)
    note = SimpleNamespace(rank=0, time=time.time() - 0.5, text="rank 0 failed in step 3: boom")
    monkeypatch.setattr("raggedvl.parallel.faults.peer_notes", lambda rank: [note])
    follower = ValueError("x")
    report_failure(1, "during setup", follower)
    as_input_error(follower)
    assert follower.raggedvl_report["line"] == "rank 1 failed during setup: ValueError: x (after rank 0: rank 0 failed " \
                                               "in step 3: boom)"


def test_the_first_own_failure_wins_over_peers_that_only_followed_it(tmp_path, monkeypatch):
    """No process group here: report_failure posts no note and aborts nothing; peers' notes are faked."""
    own = RuntimeError("injected fault on rank 1 in step 3")
    report_failure(1, "in step 3", own)
    failures = {1: _failure(tmp_path, monkeypatch, 1, own, exit_code=1)}
    time.sleep(0.01)
    note = SimpleNamespace(rank=1, time=time.time() - 0.5, text="rank 1 failed in step 3: boom")
    monkeypatch.setattr("raggedvl.parallel.faults.peer_notes", lambda rank: [note])
    follower = RuntimeError("Connection closed by peer")
    report_failure(0, "in step 3", follower)
    failures[0] = _failure(tmp_path, monkeypatch, 0, follower, exit_code=1)
    line, code = first_failure(failures)
    assert line.startswith("rank 1 failed in step 3: RuntimeError: injected fault on rank 1 in step 3 (traceback: ")
    assert line.endswith("error-1.json)") and code == 1
    alone, _ = first_failure({0: failures[0]})  # only the follower recorded: what it followed comes first
    assert alone.startswith("rank 1 failed in step 3: boom; then rank 0 failed in step 3: RuntimeError: Connection "
                            "closed by peer (traceback: "), alone


def test_a_killed_rank_without_a_record_comes_first(tmp_path, monkeypatch):
    peer = _failure(tmp_path, monkeypatch, 0, RuntimeError("gloo: connection reset"), exit_code=1)
    killed = ProcessFailure(local_rank=1, pid=101, exitcode=-9, error_file=str(tmp_path / "none.json"))
    line, code = first_failure({0: peer, 1: killed})
    assert line == "rank 1 was killed by SIGKILL (it left no report; then rank 0: RuntimeError: gloo: connection reset)"
    assert code == 1
    stopped = ProcessFailure(local_rank=0, pid=100, exitcode=-15, error_file=str(tmp_path / "none.json"))
    assert first_failure({0: stopped, 1: killed})[0].startswith("rank 1 was killed by SIGKILL")  # torchrun stopped rank 0
    assert first_failure({0: stopped, 1: peer})[0] == "rank 0: RuntimeError: gloo: connection reset (traceback: " \
        + f"{peer.error_file})"
    silent = ProcessFailure(local_rank=0, pid=100, exitcode=3, error_file=str(tmp_path / "none.json"))
    assert first_failure({0: silent}) == ("rank 0 exited with code 3 without a report", 1)


def test_the_agent_runs_as_a_module_without_runpy_warning():
    """``python -m raggedvl.app.agent`` imports the package raggedvl.parallel first; if that
    imported the agent module (faults.py once did, at module level), runpy warns "found in
    sys.modules ... prior to execution" on every ``raggedvl train``. As an error here."""
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-m", "raggedvl.app.agent", "--help"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "--nproc-per-node" in out.stdout
    assert "RuntimeWarning" not in out.stderr and "sys.modules" not in out.stderr
    imported = subprocess.run([sys.executable, "-c", "import sys, raggedvl.parallel; "
                               "print('raggedvl.app.agent' in sys.modules)"],
                              capture_output=True, text=True, env=env, timeout=300)
    assert imported.stdout.strip() == "False", imported.stderr[-2000:]


def test_join_timeout_applies_to_the_static_rendezvous_too():
    from raggedvl.app.rendezvous import join_timeout

    static = SimpleNamespace(rdzv_backend="static", rdzv_conf="join_timeout=10")
    assert join_timeout(static) == 10 and static.rdzv_conf == "join_timeout=10,timeout=10"
    assert join_timeout(SimpleNamespace(rdzv_backend="static", rdzv_conf="")) == 900  # torchrun's default
    assert join_timeout(SimpleNamespace(rdzv_backend="c10d", rdzv_conf="join_timeout=30")) == 30
    assert join_timeout(SimpleNamespace(rdzv_backend="c10d", rdzv_conf="")) == 600


def test_a_frozen_rank_that_torchrun_then_killed_is_named_as_frozen(tmp_path, monkeypatch):
    """Rank 1 froze (SIGSTOP): rank 0 timed out after finding it silent; torchrun's teardown then
    SIGKILLed rank 1, which never ran again. The line leads with the silence, not the SIGKILL."""
    timed_out = RuntimeError("Timed out waiting 20000ms for recv operation to complete")
    cause = "rank 1 (node 0, host h, pid 7) stopped responding: no heartbeat for 5 s (killed, frozen, or its node lost)"
    setattr(timed_out, "raggedvl_report", {"line": f"rank 0 failed in step 4: x (after rank 1: {cause})", "time": 1.0,
                                           "own": "rank 0 failed in step 4: RuntimeError: Timed out", "cause": cause,
                                           "after_peer": True})
    waited = _failure(tmp_path, monkeypatch, 0, timed_out, exit_code=1)
    killed = ProcessFailure(local_rank=1, pid=7, exitcode=-9, error_file=str(tmp_path / "none.json"))
    line, code = first_failure({0: waited, 1: killed})
    assert line.startswith(f"{cause}; then rank 0 failed in step 4: RuntimeError: Timed out (traceback: "), line
    assert code == 1


def _attempt_dirs(tmp_path, recorded: dict[int, dict]) -> str:
    """torchrun's error-file layout for attempts 0 and 1 of 2 local ranks; ``recorded``: local rank
    -> the raggedvl record it left in attempt 0 (the others left none). Returns attempt 1's path."""
    import json

    for rank in (0, 1):
        folder = tmp_path / "attempt_0" / str(rank)
        folder.mkdir(parents=True)
        if rank in recorded:
            (folder / "error.json").write_text(json.dumps({"message": {"raggedvl": recorded[rank]}}))
    return str(tmp_path / "attempt_1" / "0" / "error.json")


def test_a_restart_names_the_rank_torchrun_found_failed_not_the_ranks_it_stopped(tmp_path):
    """Rank 1 SIGKILLed; torchrun then stopped rank 0 with SIGTERM before it could report: only
    rank 1 is named. Without the agent's file both silent ranks are suspects."""
    import json

    from raggedvl.app.restarts import previous_attempt_failures

    error_file = _attempt_dirs(tmp_path, {})
    failed = tmp_path / "failed.json"
    failed.write_text(json.dumps({"failed": [{"local_rank": 1, "exitcode": -9}]}))
    assert previous_attempt_failures(error_file, str(failed)) == ["local rank 1 was killed by SIGKILL (it left no report)"]
    assert previous_attempt_failures(error_file, str(tmp_path / "absent.json")) == [
        "local ranks 0, 1 left no report (killed by a signal?)"]


def test_a_restart_puts_the_silent_failed_rank_before_the_peer_that_followed_it(tmp_path):
    import json

    from raggedvl.app.restarts import previous_attempt_failures

    note = {"line": "rank 0 failed in step 5: gloo: connection closed by peer", "after_peer": True}
    error_file = _attempt_dirs(tmp_path, {0: note})
    failed = tmp_path / "failed.json"
    failed.write_text(json.dumps({"failed": [{"local_rank": 0, "exitcode": 1}, {"local_rank": 1, "exitcode": -9}]}))
    assert previous_attempt_failures(error_file, str(failed)) == [
        "local rank 1 was killed by SIGKILL (it left no report)", note["line"]]


def test_a_restart_names_a_killed_rank_before_one_torchrun_stopped(tmp_path):
    """Both silent ranks among the failed (rank 0 ended by torchrun's SIGTERM before its monitor
    polled): the SIGKILLed rank is the cause, named first."""
    import json

    from raggedvl.app.restarts import previous_attempt_failures

    error_file = _attempt_dirs(tmp_path, {})
    failed = tmp_path / "failed.json"
    failed.write_text(json.dumps({"failed": [{"local_rank": 0, "exitcode": -15}, {"local_rank": 1, "exitcode": -9}]}))
    assert previous_attempt_failures(error_file, str(failed)) == [
        "local rank 1 was killed by SIGKILL (it left no report)", "local rank 0 was killed by SIGTERM (it left no report)"]

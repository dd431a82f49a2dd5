"""torchrun's agent for ``raggedvl`` commands: one line from the first failing rank, no wrapper noise.

``raggedvl train`` validates its input and then replaces itself (``os.execv``) with
``python -m raggedvl.app.agent TORCHRUN_ARGS -m raggedvl.app.cli train ...``: torchrun's own
agent (``torch.distributed.run``: the same options, rendezvous, restarts and teardown) in a
process that holds nothing of the launcher's. What it changes is what a failure prints:

- every rank records its failure in the error file torchrun gives it (``TORCHELASTIC_ERROR_FILE``,
  torchrun's ``@record`` format plus a ``"raggedvl"`` entry: the one-line report, the Unix time
  in seconds, the exit code, whether a peer's note preceded it); ranks started by this agent
  (``RAGGEDVL_AGENT=1``) print neither that line nor a traceback;
- when the job fails, this agent prints ``raggedvl: <the first failure>`` once and exits with
  that rank's exit code (2 for an input error, as the launcher's own checks; one a rank found
  while setting up reads ``raggedvl: error: <message>``, as the launcher's: :func:`as_input_error`), instead of
  torchrun's ``ChildFailedError`` block. The first failure is, in order: a rank killed by a
  signal other than SIGTERM/SIGINT/SIGHUP (those are how torchrun stops the other ranks) that
  left no record (it could not report; the line names the signal and the next rank's error),
  unless a peer had found it frozen (torchrun's teardown then ends it with SIGKILL),
  the earliest record not preceded by a peer's note or a silent peer, the earliest record (led
  by what it followed: ``rank 1 (node 1, host H, pid P) stopped responding: ...; then rank 0
  failed in step S: ...``, so a rank that waited for a killed, frozen or lost peer is never
  the one named first), a rank terminated without a record. Its
  traceback stays in the error file, whose path the line gives for errors that are not input
  errors. torchrun's own log lines are silenced (``RAGGEDVL_AGENT_VERBOSE=1`` keeps them);
- a rank whose agent is gone (killed with its node's job, SIGKILL) ends itself within a second
  (:func:`end_with_agent`) instead of training on as an orphan: its peers then see it fall
  silent and name it;
- on a multi-node job, the wait for the other nodes is shown, bounded by the join timeout and
  stopped by Ctrl-C, each with one line (``raggedvl.app.rendezvous``);
- SIGTERM and SIGUSR1 (a cluster's preemption) are passed on to the ranks, which finish their
  step, save a checkpoint and end normally; rank 0 leaves its line in the file named by
  ``RAGGEDVL_PREEMPTED_FILE`` and this agent exits with ``PREEMPTED_EXIT_CODE`` (3);
- when torchrun restarts the ranks (``--max-restarts``), the ranks it found failed (local rank,
  exit code or signal) are written to the file named by ``RAGGEDVL_FAILED_RANKS_FILE`` before
  it stops the others, so the restarted rank 0 can say which rank failed and which were only
  stopped (``raggedvl.app.restarts``);
- when the job is stopped by Ctrl-C, this agent passes SIGINT on to the ranks (torchrun's
  teardown; a second Ctrl-C is ignored rather than cut that short), prints nothing (rank 0 says
  where training stopped: ``raggedvl.app.interrupts``) and exits 130.

Under a plain ``torchrun -m raggedvl.app.cli ...`` the ranks still write the error file (torchrun's
summary then shows the message and traceback instead of ``error_file: <N/A>``) and print as
before.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
from typing import Any, NoReturn, Sequence

from raggedvl.parallel.faults import QUIET_ENV as AGENT_ENV, REPORT_ATTRIBUTE, quiet_ranks  # noqa: E402, F401
INPUT_ERROR_EXIT_CODE = 2
PREEMPTED_EXIT_CODE = 3  # the job saved a checkpoint and stopped on SIGTERM / SIGUSR1 (raggedvl.app.preemption)
PREEMPTED_FILE_ENV = "RAGGEDVL_PREEMPTED_FILE"  # where rank 0 leaves its preemption line for this agent
# exists while torchrun stops the ranks (a failure, Ctrl-C, a restart): their SIGTERM is then not a preemption
TEARDOWN_FILE_ENV = "RAGGEDVL_TEARDOWN_FILE"
# the ranks torchrun's monitor found failed in the last attempt: {"failed": [{"local_rank", "exitcode"}]}
FAILED_RANKS_FILE_ENV = "RAGGEDVL_FAILED_RANKS_FILE"


def in_teardown() -> bool:
    """True in a rank of this agent while torchrun is stopping the ranks: a SIGTERM now ends the
    rank at once, as torchrun means it, rather than asking for a preemption checkpoint."""
    path = os.environ.get(TEARDOWN_FILE_ENV)
    return bool(path) and os.path.exists(path)


def _mark_teardowns(marker: str) -> None:
    """Wrap torchrun's ``PContext.close`` (how its agent stops the ranks, with SIGTERM then
    SIGKILL) so that ``marker`` exists while it runs."""
    from torch.distributed.elastic.multiprocessing import api

    close = api.PContext.close
    if getattr(close, "raggedvl_marks", False):
        return

    def marked(self, *args, **kwargs):
        open(marker, "w").close()
        try:
            return close(self, *args, **kwargs)
        finally:
            if os.path.exists(marker):
                os.unlink(marker)

    marked.raggedvl_marks = True
    api.PContext.close = marked



def _record_failed_ranks(path: str) -> None:
    """Wrap torchrun's ``LocalElasticAgent._monitor_workers`` so that a failed attempt's failed
    ranks (those torchrun saw end before it stopped the others) are written to ``path``."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    monitor = LocalElasticAgent._monitor_workers
    if getattr(monitor, "raggedvl_records", False):
        return

    def recorded(self, *args, **kwargs):
        result = monitor(self, *args, **kwargs)
        if result.is_failed():
            failed = [{"local_rank": f.local_rank, "exitcode": f.exitcode} for f in result.failures.values()]
            try:
                with open(path, "w", encoding="utf-8") as f:
                    json.dump({"failed": failed}, f)
            except OSError:
                pass
        return result

    recorded.raggedvl_records = True
    LocalElasticAgent._monitor_workers = recorded


def record_failure(exc: BaseException, *, exit_code: int) -> bool:
    """Write this rank's failure to torchrun's error file (``TORCHELASTIC_ERROR_FILE``); False
    when there is none (not under torchrun). The one-line report, its time and whether a peer's
    note preceded it come from :func:`raggedvl.parallel.faults.report_failure` when it ran
    (``exc.raggedvl_report``), else the line is ``rank R: Type: message``. Never raises."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return False
    report = getattr(exc, REPORT_ATTRIBUTE, None) or {
        "line": f"rank {os.environ.get('RANK', '?')}: {type(exc).__name__}: {str(exc).strip()}", "time": time.time(),
        "after_peer": False}
    lines = report["line"].strip().splitlines()
    data = {"message": {
        "message": f"{type(exc).__name__}: {exc}",
        "extraInfo": {"py_callstack": "".join(traceback.format_exception(exc)), "timestamp": str(int(report["time"]))},
        "raggedvl": {**report, "line": lines[0] if lines else type(exc).__name__, "exit_code": exit_code},
    }}
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(data, f)
        return True
    except OSError:
        return False


def as_input_error(exc: BaseException) -> None:
    """Make the report :func:`raggedvl.parallel.faults.report_failure` left on ``exc`` (a
    ``ValueError`` a rank raised while setting up: bad input every rank reads alike, such as an
    evaluation set that overlaps the training pairs) read as the launcher's own input errors,
    ``error: <message>`` on one line, without the rank and phase; a report that followed a
    peer's failure is kept as it is."""
    report = getattr(exc, REPORT_ATTRIBUTE, None)
    if report is not None and not report.get("after_peer"):
        report["line"] = "error: " + " ".join(str(exc).split())


def signal_name(exitcode: int) -> str:
    """``SIGKILL`` for a process's exit code -9 (torchrun's negative code for "ended by a signal")."""
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


def first_failure(failures: dict[int, Any]) -> tuple[str, int]:
    """The line to print and the exit code for a failed job, from torchrun's
    ``ChildFailedError.failures`` (global rank -> ``ProcessFailure``). Order: see the module."""
    records = {}
    for rank, failure in failures.items():
        message = failure.message if isinstance(failure.message, dict) else {}
        if isinstance(message.get("raggedvl"), dict):
            records[rank] = message["raggedvl"]
    by_time = sorted(records, key=lambda r: (records[r]["time"], r))
    killed = sorted(r for r, f in failures.items() if r not in records and f.exitcode < 0)
    # SIGTERM / SIGINT / SIGHUP: most likely torchrun's own teardown of the other ranks
    hard = [r for r in killed if -failures[r].exitcode not in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)]
    # a rank a peer found frozen is SIGKILLed by torchrun's teardown (a stopped process ignores SIGTERM)
    frozen = {r for r in by_time if "stopped responding" in str(records[r].get("cause"))}
    hard = [r for r in hard if not any(str(records[f]["cause"]).startswith(f"rank {r} ") for f in frozen)]
    if hard or (killed and not by_time):
        rank = (hard or killed)[0]
        line = f"rank {rank} was killed by {signal_name(failures[rank].exitcode)} (it left no report"
        line += f"; then {records[by_time[0]]['line']})" if by_time else ")"
        return line, 1
    if by_time:
        own = [r for r in by_time if not records[r].get("after_peer")]
        rank = (own or by_time)[0]
        record = records[rank]
        line, code = record["line"], int(record.get("exit_code", 1))
        if not own and record.get("cause") and record.get("own"):  # the peer it followed comes first
            line = f"{record['cause']}; then {record['own']}"
        if code != INPUT_ERROR_EXIT_CODE:
            line += f" (traceback: {failures[rank].error_file})"
        return line, code
    rank = min(failures)
    return f"rank {rank} exited with code {failures[rank].exitcode} without a report", 1


_TORCHRUN_LOGGERS = ("torch.distributed.run", "torch.distributed.elastic", "torch.distributed.launcher")


def _silence_torchrun() -> None:
    """torchrun's loggers to CRITICAL (``RAGGEDVL_AGENT_VERBOSE=1`` keeps them)."""
    for name, logger in list(logging.root.manager.loggerDict.items()):
        if name.startswith(_TORCHRUN_LOGGERS) and isinstance(logger, logging.Logger):
            logger.setLevel(logging.CRITICAL)


def _worker_pids() -> list[int]:
    """The processes this agent started (its children, from ``/proc``; [] where there is none)."""
    me, children = os.getpid(), []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me:
            children.append(int(entry))
    return children


def _forward_to_workers(signum, frame) -> None:
    """SIGTERM / SIGUSR1 (preemption): pass it on to the ranks, which finish their step, save a
    checkpoint and end (``raggedvl.app.preemption``); the agent keeps waiting for them."""
    for pid in _worker_pids():
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def _first_signal_only() -> None:
    """torchrun's handler for SIGINT / SIGTERM / ... raises ``SignalException`` and its agent then
    stops the ranks (the signal, then SIGKILL after its shutdown timeout). A second Ctrl-C would
    raise again inside that shutdown and leave ranks running: each signal is ignored after its
    first delivery. Wraps the private ``_terminate_process_handler`` that ``start`` installs
    (looked up at call time); a torch without it keeps its own behaviour."""
    from torch.distributed.elastic.multiprocessing import api

    handler = getattr(api, "_terminate_process_handler", None)
    if handler is None or getattr(handler, "raggedvl_first_only", False):
        return

    def first_only(signum, frame):
        if signum == signal.SIGTERM:  # preemption: the ranks save and end; torchrun waits for them
            _forward_to_workers(signum, frame)
            return
        signal.signal(signum, signal.SIG_IGN)
        handler(signum, frame)

    first_only.raggedvl_first_only = True
    api._terminate_process_handler = first_only


def end_with_agent(poll_s: float = 1.0) -> None:
    """In a rank of this agent: a daemon thread that ends this process (exit 1, one line) once
    the agent that started it is gone (its parent process changed: the agent was killed, or its
    node's job was). A torchrun rank runs in a session of its own, so nothing else would stop it."""
    agent = os.getppid()

    def watch() -> None:
        while os.getppid() == agent:
            time.sleep(poll_s)
        print(f"raggedvl: rank {os.environ.get('RANK', '?')}: the torchrun agent that started it (pid {agent}) is "
              "gone; ending this rank", file=sys.stderr, flush=True)
        os._exit(1)

    threading.Thread(target=watch, name="raggedvl-agent-watch", daemon=True).start()


def main(argv: Sequence[str] | None = None) -> int:
    """``torchrun ARGS`` with one-line failure reports; returns the exit code (128 + the signal
    when the job was stopped by one: 130 for Ctrl-C, silently, rank 0 having said where)."""
    verbose = os.environ.get("RAGGEDVL_AGENT_VERBOSE") == "1"
    loglevel = os.environ.get("LOGLEVEL")
    if not verbose:  # torchrun's loggers take their level from LOGLEVEL when its modules are imported
        os.environ["LOGLEVEL"] = "CRITICAL"
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, parse_min_max_nnodes, run

    from raggedvl.app.rendezvous import NodesMissing, show_waits

    if not verbose:
        _silence_torchrun()
        if loglevel is None:  # not passed on to the ranks
            del os.environ["LOGLEVEL"]
        else:
            os.environ["LOGLEVEL"] = loglevel
    os.environ[AGENT_ENV] = "1"
    _first_signal_only()
    signal.signal(signal.SIGUSR1, _forward_to_workers)
    fd, preempted = tempfile.mkstemp(prefix="raggedvl-preempted-")
    os.close(fd)
    os.environ[PREEMPTED_FILE_ENV] = preempted
    os.environ[TEARDOWN_FILE_ENV] = preempted + ".teardown"
    _mark_teardowns(os.environ[TEARDOWN_FILE_ENV])
    os.environ[FAILED_RANKS_FILE_ENV] = preempted + ".failed"
    _record_failed_ranks(os.environ[FAILED_RANKS_FILE_ENV])
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    if not args.standalone and parse_min_max_nnodes(args.nnodes)[1] > 1:
        show_waits(args)
    try:
        run(args)
        if os.path.getsize(preempted):  # rank 0 saved and said where: a requeue script's exit code
            return PREEMPTED_EXIT_CODE
    except ChildFailedError as exc:
        line, code = first_failure(exc.failures)
        print(f"raggedvl: {line}", file=sys.stderr, flush=True)
        return code
    except NodesMissing as exc:
        print(f"raggedvl: {exc}", file=sys.stderr, flush=True)
        return 1
    except SignalException as exc:  # the job was stopped (Ctrl-C, SIGTERM): the ranks are gone
        if exc.sigval != signal.SIGINT:  # Ctrl-C: rank 0 printed where training stopped (parallel.interrupts)
            print(f"raggedvl: stopped by {signal.Signals(exc.sigval).name}", file=sys.stderr, flush=True)
        return 128 + int(exc.sigval)
    finally:
        for path in (preempted, os.environ[FAILED_RANKS_FILE_ENV]):
            if os.path.exists(path):
                os.unlink(path)
    return 0


def exit_now(code: int) -> NoReturn:
    """End this process with ``code`` without the interpreter's teardown: ``atexit`` handlers
    run (logging, trackers, multiprocessing's workers), stdout and stderr are flushed, then
    ``os._exit``: finalising the thousands of modules torch and transformers import takes seconds
    per process (BENCHMARKS.md "The launcher"). Only for a process whose files are all
    closed: the ``raggedvl`` command (``raggedvl.app.cli.run``) and this agent."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or broken pipe: nothing left to say
            pass
    os._exit(code)


if __name__ == "__main__":
    from raggedvl.app.closed_output import drop_output_when_closed

    drop_output_when_closed()  # the command's reader gone: the job runs on, its output dropped
    exit_now(main())

"""Run a command-line job in a test (``raggedvl train`` under torchrun, an example, a script)
with the two bounds of tests/dist/harness.py, so that a loaded machine's slow start-up is not
mistaken for a hang:

- start-up: until the job prints ``ready`` (a regular expression searched in stdout and stderr,
  chosen to appear only once every rank has started, e.g. the line ``raggedvl train`` prints
  after the process group formed), at most ``startup_timeout`` seconds (600 by default);
- run: ``timeout`` seconds from the moment ``ready`` appeared, stretched by the machine's
  slowdown measured while the job runs (tests/slowdown.py: wall over CPU time of a busy loop,
  re-measured every 20 s; the largest value counts, clipped to [1, 10]).

A single-process script with no line that marks the end of its start-up passes ``ready=None``:
its run bound then counts from launch (start-up included), still stretched by the slowdown.

A job past either bound is killed with its whole process session (torchrun and its ranks) and
``JobResult.timed_out`` says which bound and when; ``run_job`` turns that into a failure that
shows the output's tail.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from tests import slowdown

STARTUP_TIMEOUT_S = 600.0
# Printed by rank 0 of `raggedvl train` after every rank joined the process group and built its
# data and model (train/loop.py), i.e. when start-up is over.
TRAIN_READY = r"training \d+ steps?, world size \d+"


@dataclass
class JobResult:
    returncode: int
    stdout: str
    stderr: str
    ended_at: float  # time.time() when the job ended (or was killed)
    ready_after_s: float | None  # seconds from launch to the ready line; None if never seen
    timed_out: str | None  # which bound was exceeded, or None
    slowdown: float  # the run bound's stretch factor (1 on an idle machine)

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def describe(self, chars: int = 3000) -> str:
        head = f"{self.timed_out}\n" if self.timed_out else ""
        return f"{head}exit code {self.returncode}\n--- stdout\n{self.stdout[-chars:]}\n--- stderr\n{self.stderr[-chars:]}"


def _default_sigint() -> None:
    """In the child before it executes: SIGINT back to its default action. A test run started in
    the background by a non-interactive shell (``cmd &``, nohup, some CI runners) inherits SIGINT
    ignored, and Python then installs no KeyboardInterrupt handler, so a job would shrug off the
    Ctrl-C a test sends it. The job runs in its own session, so no terminal's Ctrl-C reaches it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Job:
    """One started job; call ``poll()`` until it returns a ``JobResult`` (or ``wait()``)."""

    def __init__(self, cmd: Sequence[str], *, ready: str | None, timeout: float, startup_timeout: float = STARTUP_TIMEOUT_S,
                 env: dict[str, str] | None = None, cwd: str | os.PathLike | None = None, merged: bool = False) -> None:
        """``merged``: stderr goes into stdout (one stream, lines in the order they were written);
        ``ready=None``: the run bound starts at launch (module docstring)."""
        self.ready = None if ready is None else re.compile(ready, re.MULTILINE)
        self.timeout, self.startup_timeout = timeout, startup_timeout
        self._out = tempfile.TemporaryFile(mode="w+", encoding="utf-8", errors="replace")
        self._err = tempfile.TemporaryFile(mode="w+", encoding="utf-8", errors="replace")
        self.started = time.monotonic()
        self.ready_at: float | None = self.started if ready is None else None
        self.slow = 1.0
        self.proc = subprocess.Popen(list(map(str, cmd)), stdout=self._out, stderr=subprocess.STDOUT if merged else self._err, text=True,
                                     env=env, cwd=cwd, start_new_session=True, preexec_fn=_default_sigint)
        self.result: JobResult | None = None

    def _read(self) -> tuple[str, str]:
        texts = []
        for f in (self._out, self._err):
            f.flush()
            f.seek(0)
            texts.append(f.read())
        return texts[0], texts[1]

    def _finish(self, timed_out: str | None) -> JobResult:
        stdout, stderr = self._read()
        ready_after = None if self.ready_at is None else self.ready_at - self.started
        self.result = JobResult(self.proc.returncode, stdout, stderr, time.time(), ready_after, timed_out, self.slow)
        self._out.close()
        self._err.close()
        return self.result

    def poll(self) -> JobResult | None:
        if self.result is not None:
            return self.result
        now = time.monotonic()
        if self.ready_at is None and self.ready.search("\n".join(self._read())):
            self.ready_at = now
        if self.proc.poll() is not None:
            return self._finish(None)
        if self.ready_at is not None:
            self.slow = max(self.slow, slowdown.clip(slowdown.current()))
        bound = self.timeout * self.slow
        if self.ready_at is None and now - self.started > self.startup_timeout:
            why = f"the job did not print {self.ready.pattern!r} (start-up) within {self.startup_timeout:.0f} s"
        elif self.ready_at is not None and now - self.ready_at > bound:
            why = (f"the job ran {bound:.0f} s (timeout {self.timeout:.0f} s x slowdown {self.slow:.1f}) after its "
                   f"start-up ended ({self.ready_at - self.started:.1f} s after launch) without finishing: a hang?")
        else:
            return None
        os.killpg(self.proc.pid, signal.SIGKILL)  # torchrun and every rank
        self.proc.wait()
        return self._finish(why)

    def wait(self) -> JobResult:
        while (result := self.poll()) is None:
            time.sleep(0.2)
        return result


def run_job(cmd: Sequence[str], *, ready: str | None, timeout: float, **kwargs) -> JobResult:
    """Start ``cmd``, wait for it under both bounds, and return its result. Raises
    ``AssertionError`` with the output's tail when a bound was exceeded, or when the job
    succeeded without printing ``ready`` (the marker is stale: the run bound never applied)."""
    result = Job(cmd, ready=ready, timeout=timeout, **kwargs).wait()
    if result.timed_out:
        raise AssertionError(result.describe())
    if result.returncode == 0 and result.ready_after_s is None:
        raise AssertionError(f"the job never printed {ready!r}; fix the start-up marker\n{result.describe()}")
    return result


def run_jobs(commands: dict, root: Path, *, ready: str, timeout: float, cwd: str | os.PathLike | None = None) -> dict:
    """Start every ``name -> (argv, env)`` job at once (the costly part of the fault tests is
    starting them), each under both bounds; return name -> (return code, output, end time,
    ``root/NAME``, slowdown). The output starts with the bound a killed job exceeded (its test
    then fails); polling gives each job its own end time."""
    running = {name: Job(argv, env=env, cwd=cwd, ready=ready, timeout=timeout, merged=True)
               for name, (argv, env) in commands.items()}
    done = {}
    while len(done) < len(running):
        for name, job in running.items():
            if name not in done and (result := job.poll()) is not None:
                done[name] = (result.returncode, (result.timed_out or "") + result.output, result.ended_at,
                              root / name, result.slowdown)
        time.sleep(0.2)
    return done


def processes_mentioning(text: str) -> list[str]:
    """Command lines of live processes that mention ``text`` (a run directory): a job's ranks
    must not outlive it."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmd:
            found.append(f"{pid}: {cmd}")
    return found

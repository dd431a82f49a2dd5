"""Run whole jobs (``raggedvl train``, torchrun scripts) as subprocesses for the fault tests, and
check that none of their processes outlives them."""

import os
import signal
import subprocess
import time
from pathlib import Path


def run_jobs(commands: dict, root: Path, bound_s: float, cwd: Path | None = None) -> dict:
    """Start every ``name -> (argv, env)`` job at once, each in its own session with its output in
    ``root/NAME.log``; return name -> (return code, output, end time, ``root/NAME``). A job still
    running after ``bound_s`` seconds is killed with its whole session (its test then fails)."""
    running = {}
    for name, (argv, env) in commands.items():
        log = open(root / f"{name}.log", "w+")  # noqa: SIM115 - closed below
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        running[name] = (proc, log)
    done, deadline = {}, time.monotonic() + bound_s
    while len(done) < len(running):  # poll, so each job's end time is its own
        for name, (proc, log) in running.items():
            if name in done or (proc.poll() is None and time.monotonic() < deadline):
                continue
            if proc.poll() is None:  # a job that outlived the bound: end its whole session (the test fails)
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            end = time.time()
            log.seek(0)
            done[name] = (proc.returncode, log.read(), end, root / name)
            log.close()
        time.sleep(0.2)
    return done


def processes_mentioning(text: str) -> list[str]:
    """Command lines of live processes that mention ``text`` (a run directory)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmd:
            found.append(f"{pid}: {cmd}")
    return found

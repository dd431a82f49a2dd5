"""Run one command and sample the memory of its whole process tree with psutil.

Every ``interval_s`` the monitor walks the command's process and all its descendants and reads
each one's RSS and PSS (``/proc/PID/smaps_rollup``; PSS divides shared pages among the
processes that map them, so the sum over processes is the job's real footprint) and the
kernel's own peak RSS (``VmHWM`` of ``/proc/PID/status``: exact up to the last sample, however
short the peak). It keeps, per process, the peak RSS (the larger of the sampled RSS and VmHWM)
and a role, and the peak over samples of the summed PSS.

The summed PSS has no kernel high-water mark: it is the largest sampled sum, so a peak shorter
than the interval (e.g. one training step's activations) may be missed; a 1-process job's
summed PSS is at most its process's peak RSS.

Roles: ``torchrun`` (a ``torch.distributed.run`` process), ``worker`` (a child of torchrun, or
the command itself when it trains in-process), ``launcher`` (the command when it starts
torchrun), ``other``. Sampling misses peaks shorter than the interval; the interval and the
number of samples are reported with the figures.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from dataclasses import dataclass, field

import psutil

MiB = 1024 * 1024


@dataclass
class ProcPeak:
    pid: int
    role: str
    cmd: str
    peak_rss: int = 0
    ppid: int = -1


@dataclass
class JobMemory:
    procs: dict[int, ProcPeak] = field(default_factory=dict)
    peak_pss_sum: int = 0
    samples: int = 0
    interval_s: float = 0.5

    def peak_rss(self, role: str) -> int:
        """Largest peak RSS (bytes) among processes of ``role`` (0 if none)."""
        return max((p.peak_rss for p in self.procs.values() if p.role == role), default=0)

    def count(self, role: str) -> int:
        return sum(1 for p in self.procs.values() if p.role == role)

    def to_dict(self) -> dict:
        return {
            "peak_pss_sum_mib": self.peak_pss_sum / MiB, "samples": self.samples, "interval_s": self.interval_s,
            "procs": [{"pid": p.pid, "role": p.role, "peak_rss_mib": p.peak_rss / MiB, "cmd": p.cmd[:160]}
                      for p in self.procs.values()],
        }


def process_tree(root_pid: int) -> list[psutil.Process]:
    """``root_pid``'s process and all its descendants (empty once it is gone)."""
    try:
        root = psutil.Process(root_pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def _high_water_mark(pid: int) -> int:
    """``pid``'s peak resident set since it started or last exec'd (bytes; ``VmHWM``), 0 if unreadable."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _is_torchrun(cmdline: list[str]) -> bool:
    """torchrun's agent: ``torch.distributed.run``, the ``torchrun`` script, or raggedvl's own
    wrapper of it (``raggedvl.app.agent``, which ``raggedvl train`` execs into: same pid)."""
    return ("torch.distributed.run" in cmdline or "raggedvl.app.agent" in cmdline
            or any(c.endswith("/torchrun") for c in cmdline[:2]))


def _role(proc: psutil.Process, root_pid: int, cmdline: list[str], torchrun_pids: set[int]) -> str:
    if proc.pid in torchrun_pids:
        return "torchrun"
    try:
        parent = proc.ppid()
    except psutil.Error:
        parent = -1
    if parent in torchrun_pids:
        return "worker"
    if proc.pid == root_pid:
        return "root"
    return "other"


class _Sampler(threading.Thread):
    def __init__(self, root_pid: int, interval_s: float) -> None:
        super().__init__(daemon=True)
        self.root_pid, self.interval_s = root_pid, interval_s
        self.memory = JobMemory(interval_s=interval_s)
        self.stop_event = threading.Event()
        self._torchrun: set[int] = set()

    def sample(self) -> None:
        procs = process_tree(self.root_pid)
        if not procs:
            return
        fresh = {}
        for proc in procs:  # name new processes first, so a worker seen before torchrun gets its role
            if proc.pid not in self.memory.procs:
                try:
                    fresh[proc.pid] = proc.cmdline()
                except psutil.Error:
                    continue
                if _is_torchrun(fresh[proc.pid]):
                    self._torchrun.add(proc.pid)
        root = self.memory.procs.get(self.root_pid)
        if root is not None and self.root_pid not in self._torchrun:  # a launcher that exec'd into the agent
            try:
                if _is_torchrun(psutil.Process(self.root_pid).cmdline()):
                    self._torchrun.add(self.root_pid)
                    root.role, root.cmd = "torchrun", " ".join(psutil.Process(self.root_pid).cmdline())
                    for entry in self.memory.procs.values():  # ranks seen before the exec was noticed
                        if entry.ppid == self.root_pid:
                            entry.role = "worker"
            except psutil.Error:
                pass
        pss_sum = 0
        for proc in procs:
            try:
                info = proc.memory_full_info()
                entry = self.memory.procs.get(proc.pid)
                if entry is None:
                    cmdline = fresh.get(proc.pid) or proc.cmdline()
                    role = _role(proc, self.root_pid, cmdline, self._torchrun)
                    entry = self.memory.procs[proc.pid] = ProcPeak(proc.pid, role, " ".join(cmdline), ppid=proc.ppid())
                entry.peak_rss = max(entry.peak_rss, info.rss, _high_water_mark(proc.pid))
                pss_sum += getattr(info, "pss", info.rss)
            except psutil.Error:
                continue
        self.memory.peak_pss_sum = max(self.memory.peak_pss_sum, pss_sum)
        self.memory.samples += 1

    def run(self) -> None:
        while not self.stop_event.is_set():
            self.sample()
            self.stop_event.wait(self.interval_s)


@dataclass
class RunOutcome:
    returncode: int
    wall_s: float
    memory: JobMemory
    start_epoch_s: float


def run_monitored(cmd: list[str], *, env: dict[str, str], log_path: str, timeout_s: float,
                  interval_s: float = 0.5, cwd: str | None = None) -> RunOutcome:
    """Run ``cmd`` (stdout and stderr to ``log_path``), sampling its process tree's memory.

    The root process's role becomes ``launcher`` when it started torchrun and ``worker``
    otherwise. On timeout the whole process group is killed and the return code is -9."""
    with open(log_path, "w") as log:
        start_epoch = time.time()
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True)
        sampler = _Sampler(proc.pid, interval_s)
        sampler.start()
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            code = proc.wait()
            code = -9 if code >= 0 else code
        wall = time.perf_counter() - t0
        sampler.stop_event.set()
        sampler.join()
    memory = sampler.memory
    has_torchrun = any(p.role == "torchrun" for p in memory.procs.values())
    for p in memory.procs.values():
        if p.role == "root":
            p.role = "launcher" if has_torchrun else "worker"
    return RunOutcome(code, wall, memory, start_epoch)

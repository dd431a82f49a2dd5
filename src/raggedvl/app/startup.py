"""Where ``raggedvl train`` spends its time before the first step, for ``metrics.jsonl``.

A :class:`StartupClock` holds the Unix time the command started (the launching process's
start, read from ``/proc`` where available) and named phases in seconds. The launcher times
its own checks (``launcher_checks`` when it starts the ranks right after the checks made
without torch; else ``launcher_imports``, ``launcher_data``, ``launcher_cost_scan``) and hands the
clock to the ranks it starts through the environment (``RAGGEDVL_STARTUP``, JSON); each rank
adds ``imports`` (its process start to the training modules imported), ``data``,
``cost_scan``, ``model`` and ``first_step``. Rank 0 writes the result as the ``startup``
record. A single-process run has no separate launcher: its checks are its own phases.

:func:`start_line` is what the command prints once its checks pass, before the part of a cold
start that prints nothing of its own (imports, the data, the model's download and loading).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

from raggedvl.app.wording import counted

ENV = "RAGGEDVL_STARTUP"


def process_start_time() -> float:
    """Unix time this process started (``/proc/self/stat``), or now where /proc is missing."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime, in clock ticks after boot
        with open("/proc/stat", encoding="ascii") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


@dataclass
class StartupClock:
    """``command_start``: Unix seconds; ``phases_s``: phase name -> seconds."""

    command_start: float = field(default_factory=process_start_time)
    phases_s: dict[str, float] = field(default_factory=dict)

    def to_env(self) -> str:
        return json.dumps({"command_start": self.command_start, "phases_s": self.phases_s})

    @classmethod
    def from_env(cls) -> "StartupClock":
        """The launcher's clock (its phases renamed ``launcher_*``), or a fresh one."""
        raw = os.environ.get(ENV)
        if not raw:
            return cls()
        data = json.loads(raw)
        return cls(data["command_start"], {f"launcher_{k}": v for k, v in data["phases_s"].items()})

    def add(self, phases: dict[str, float]) -> None:
        self.phases_s.update({k: round(v, 4) for k, v in phases.items()})

    def since_start(self) -> float:
        return time.time() - self.command_start


def start_line(cfg: Any, processes: int) -> str:
    """The one line the launcher (or rank 0 under a torchrun it did not start) prints before the
    silent part of a start: the model and data ``cfg`` (a ``TrainConfig``) loads, on how many
    ``processes``."""
    on = counted(processes, "process", "processes")
    return f"raggedvl: loading model {cfg.model} and data {', '.join(cfg.datasets)} on {on}..."

"""How much slower than its own CPU time a process runs right now: the factor by which test
bounds on wall-clock time (tests/dist/harness.py, tests/jobs.py) are stretched on a loaded
machine, so that waiting for the CPU is not mistaken for a hang.

The measure is wall time over CPU time of work that needs only the CPU: about 1 on an idle
machine, about N / cores when N runnable processes compete for the cores. It needs no reference
machine and no calibration constant. Bounds are stretched by at most ``MAX_SLOWDOWN``, so a real
hang is still caught, later.
"""

from __future__ import annotations

import time

MAX_SLOWDOWN = 10.0


def clip(slowdown: float) -> float:
    """``slowdown`` clipped to [1, MAX_SLOWDOWN]."""
    return min(MAX_SLOWDOWN, max(1.0, slowdown))


def measure(cpu_s: float = 0.2) -> float:
    """Wall seconds per CPU second of a busy loop that uses ``cpu_s`` CPU seconds (unclipped)."""
    wall0, cpu0 = time.perf_counter(), time.process_time()
    while time.process_time() - cpu0 < cpu_s:
        pass
    return (time.perf_counter() - wall0) / max(1e-9, time.process_time() - cpu0)


_last: tuple[float, float] | None = None  # (time.monotonic() of the measure, its value)


def current(max_age_s: float = 20.0) -> float:
    """``measure()``, repeated at most every ``max_age_s`` seconds (cached in between)."""
    global _last
    now = time.monotonic()
    if _last is None or now - _last[0] > max_age_s:
        _last = (now, measure())
    return _last[1]

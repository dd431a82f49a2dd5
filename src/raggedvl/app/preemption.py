"""Preemption: SIGTERM or SIGUSR1 stops ``raggedvl train`` after the current step, with a checkpoint.

Clusters end jobs with a signal and a grace period (SLURM sends SIGTERM, or SIGUSR1 ahead of
the time limit with ``--signal``; Kubernetes SIGTERM with ``terminationGracePeriodSeconds``).
On every rank :class:`PreemptionRequest` records the first such signal instead of dying; the
rank's flag travels in the step's statistics gather, so every rank learns of it in the same
step, whichever rank (or the agent, which forwards it) received it. That step completes on
every rank, the run writes a checkpoint of it (unless more than ``--preemption-grace-s``
seconds have passed since the signal: then it stops without saving, saying so), rank 0 prints
one line (``raggedvl: preempted at step N by SIGTERM; checkpoint: PATH; resume with
--resume``), and the command exits with :data:`PREEMPTED_EXIT_CODE`, which a requeue script
can tell apart from a failure (1), bad input (2) and Ctrl-C (130).

Under the agent (``raggedvl.app.agent``) the ranks end normally (so torchrun does not
restart them) and rank 0 writes its line to the file named by :data:`PREEMPTED_FILE_ENV`; the
agent then exits with :data:`PREEMPTED_EXIT_CODE`. The SIGTERM with which torchrun itself stops
the ranks (after a failure, on Ctrl-C, before a restart) still ends them at once: the agent
marks those moments (``raggedvl.app.agent.in_teardown``). Under a plain ``torchrun``
without the agent every SIGTERM is a preemption, so a rank stuck outside a collective is ended
only by torchrun's SIGKILL after its shutdown timeout.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from raggedvl.app.agent import PREEMPTED_EXIT_CODE, PREEMPTED_FILE_ENV, in_teardown

PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
__all__ = ["PREEMPTED_EXIT_CODE", "PREEMPTED_FILE_ENV", "PREEMPT_SIGNALS", "PreemptionRequest", "report_preempted"]


class PreemptionRequest:
    """The first SIGTERM / SIGUSR1 this process received while installed: ``signum`` and its
    ``time.monotonic()`` time (None until one arrives). Install from the main thread."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.at: float | None = None
        self._previous: dict[int, object] = {}

    def install(self) -> "PreemptionRequest":
        for sig in PREEMPT_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._record)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _record(self, signum, frame) -> None:
        if signum == signal.SIGTERM and in_teardown():  # torchrun stopping the ranks: end as it means
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if self.signum is None:
            self.signum, self.at = signum, time.monotonic()

    def seconds_since(self) -> float:
        """Seconds since the signal, or -1.0 when none arrived (what a rank contributes to the
        step's gather: the maximum over ranks says whether any rank was signalled and how long ago)."""
        return -1.0 if self.at is None else time.monotonic() - self.at

    @property
    def name(self) -> str:
        return "a preemption signal" if self.signum is None else signal.Signals(self.signum).name


def report_preempted(line: str) -> None:
    """Leave rank 0's line for the agent (no-op outside it)."""
    path = os.environ.get(PREEMPTED_FILE_ENV)
    if path:
        Path(path).write_text(line + "\n", encoding="utf-8")

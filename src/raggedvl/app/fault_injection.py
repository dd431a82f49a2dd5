"""Fault injection for tests: ``RAGGEDVL_FAULT="KIND:RANK:STEP"`` makes one rank fail on purpose.

``raggedvl train`` installs :func:`inject_fault` as a step hook when ``RAGGEDVL_FAULT`` is set,
and the ``RaggedTrainer`` tests install it as a ``TrainerCallback``; the training code itself
never calls it.
"""

from __future__ import annotations

import os
import signal
import sys
import time

FAULT_KINDS = ("raise", "kill", "hang", "term")
FAULT_ENV = "RAGGEDVL_FAULT"


def inject_fault(rank: int, step: int) -> None:
    """Testing aid: ``RAGGEDVL_FAULT="KIND:RANK:STEP"`` makes rank RANK fail after STEP steps.

    KIND is ``raise`` (a ``RuntimeError``), ``kill`` (SIGKILL to itself), ``hang`` (sleep
    forever) or ``term`` (SIGTERM to itself, as a cluster's preemption: the step goes on), at the
    start of 1-based step STEP + 1. Before acting it prints ``raggedvl:
    RAGGEDVL_FAULT=...: rank R will KIND in step S at unix time T`` to stderr (tests measure
    from T). No-op when the variable is unset, names another rank or step, or in a restarted
    attempt of a torchrun job; ``ValueError``
    for a malformed value.
    """
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    parts = spec.split(":")
    if len(parts) != 3 or parts[0] not in FAULT_KINDS or not all(p.isdigit() for p in parts[1:]):
        raise ValueError(f"RAGGEDVL_FAULT={spec!r} must be KIND:RANK:STEP with KIND in {FAULT_KINDS}, e.g. 'raise:1:2'")
    kind, fault_rank, fault_step = parts[0], int(parts[1]), int(parts[2])
    if fault_rank != rank or fault_step != step or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return  # a torchrun restart of the job does not repeat the fault
    print(f"raggedvl: RAGGEDVL_FAULT={spec}: rank {rank} will {kind} in step {step + 1} at unix time {time.time():.3f}",
          file=sys.stderr, flush=True)
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "term":
        os.kill(os.getpid(), signal.SIGTERM)
        return
    if kind == "hang":
        while True:
            time.sleep(3600)
    raise RuntimeError(f"injected fault on rank {rank} in step {step + 1} (RAGGEDVL_FAULT={spec})")

"""Capture, restore and replay a process's random number generator states.

One state format serves both users: exact resume (``raggedvl train`` checkpoints every rank's
state, all CUDA devices included) and GradCache (each chunk's forward is replayed with the state
it first ran with, so dropout draws the same masks). A state is a dict: ``"torch"`` (CPU
generator), ``"python"`` (``random.getstate()``), and ``"cuda"`` (one state per device: every
visible device in order, or those listed in ``"cuda_devices"``).
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator, Sequence
from typing import Any

import torch


def capture_rng_state(cuda_devices: Sequence[int] | None = None) -> dict[str, Any]:
    """The CPU, Python and CUDA generator states. ``cuda_devices``: the CUDA device indices to
    include (``None``: every visible device when CUDA is available; ``[]``: none)."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if cuda_devices is None:
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state_all()
    elif cuda_devices:
        state["cuda_devices"] = list(cuda_devices)
        state["cuda"] = [torch.cuda.get_rng_state(i) for i in cuda_devices]
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Set the generators to ``state`` (from :func:`capture_rng_state`, possibly after a
    ``torch.load(weights_only=True)`` round trip). CUDA states are skipped without CUDA."""
    torch.set_rng_state(state["torch"])
    random.setstate(_as_tuple(state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        if "cuda_devices" in state:
            for index, cuda_state in zip(state["cuda_devices"], state["cuda"]):
                torch.cuda.set_rng_state(cuda_state, index)
        else:
            torch.cuda.set_rng_state_all(state["cuda"])


@contextlib.contextmanager
def replayed_rng_state(state: dict[str, Any]) -> Iterator[None]:
    """Run the block from ``state``; afterwards the generators continue as if it had not run."""
    saved = capture_rng_state(state.get("cuda_devices", None if "cuda" in state else []))
    restore_rng_state(state)
    try:
        yield
    finally:
        restore_rng_state(saved)


def _as_tuple(x: Any) -> Any:
    # weights_only loading may return lists where random.getstate() produced tuples
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x

"""Capture and restore a process's random number generator states (for exact resume)."""

from __future__ import annotations

import random
from typing import Any

import torch


def capture_rng_state() -> dict[str, Any]:
    """Torch CPU (and CUDA, when present) generator states and Python's ``random`` state."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(_as_tuple(state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _as_tuple(x: Any) -> Any:
    # weights_only loading may return lists where random.getstate() produced tuples
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x

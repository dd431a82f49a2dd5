"""Small collectives on Python values: barrier, all-reduce max / mean, float and object gathers.

Each is a no-op (returns its input, or ``[obj]``) without a process group, so the same code runs
in one plain process and under torchrun. Every one is a collective when a group exists: all
ranks must call it, in the same order, and it is bounded by the group's timeout
(:func:`raggedvl.parallel.runtime.init_distributed`). None carries gradient.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from raggedvl.parallel.runtime import is_distributed


def barrier() -> None:
    """Synchronise all ranks (no-op without a process group). Bounded by the group's timeout."""
    if is_distributed():
        dist.barrier()


def _all_reduce_scalar(value: float, op: dist.ReduceOp) -> float:
    t = torch.tensor([value], dtype=torch.float64, device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=op)
    return float(t.item())


def all_reduce_max(value: float) -> float:
    """Max of a Python float over ranks (one float64 all-reduce; no-op without a process group)."""
    return _all_reduce_scalar(value, dist.ReduceOp.MAX) if is_distributed() else value


def all_reduce_mean(value: float) -> float:
    """Mean of a Python float over ranks (one float64 all-reduce of the sum, divided by the world
    size; no-op without a process group)."""
    if not is_distributed():
        return value
    return _all_reduce_scalar(value, dist.ReduceOp.SUM) / dist.get_world_size()


def all_gather_floats(values: torch.Tensor) -> list[list[float]]:
    """Every rank's ``values`` (a 1-D tensor of k numbers, the same k on every rank, on this
    rank's device) as float64 lists indexed by rank: one float64 ``all_gather`` of k numbers
    (none without a process group) and one device-to-host copy, the only host sync. Raises
    ``ValueError`` for a tensor that is not 1-D."""
    if values.dim() != 1:
        raise ValueError(f"all_gather_floats takes a 1-D tensor of k numbers, got shape {list(values.shape)}")
    values = values.detach().to(torch.float64)
    if not is_distributed():
        return [values.tolist()]
    values = values.to("cuda" if dist.get_backend() == "nccl" else "cpu")
    out = [torch.empty_like(values) for _ in range(dist.get_world_size())]
    dist.all_gather(out, values)
    return torch.stack(out).tolist()


def all_gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj`` as a list indexed by rank (``[obj]`` without a process group).

    Uses ``all_gather_object`` (pickle between the job's own ranks, never from a file)."""
    if not is_distributed():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out

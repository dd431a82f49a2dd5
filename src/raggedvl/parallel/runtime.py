"""Process-group lifecycle: read the torchrun environment once, pick the backend, tear down.

``raggedvl.parallel`` is the only package that imports ``torch.distributed``; everything else
asks this module for the rank and world size, which are 0 and 1 when no process group exists,
so the same code runs in one plain process, under ``torchrun`` on CPUs (gloo) and on GPUs
(NCCL).

Timeouts: every collective issued on a group created by :func:`init_distributed` is bounded by
``timeout_s`` (default :data:`DEFAULT_TIMEOUT_S` = 1800 s, PyTorch's own default for gloo).
When one rank stops participating (crash, exception, fewer batches), the others raise
``RuntimeError`` from the collective after at most ``timeout_s`` seconds instead of hanging.
On NCCL the watchdog enforces the same bound (``TORCH_NCCL_ASYNC_ERROR_HANDLING`` is set to 1
unless the user set it) and aborts the process group.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 1800.0
"""Default bound, in seconds, on every collective of a group made by :func:`init_distributed`."""


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits: ``rank`` in ``[0, world_size)``, ``local_rank`` on its node,
    the ``device`` its tensors should live on and the ``backend`` (``"gloo"``, ``"nccl"`` or
    ``"none"`` when running as a single process without a group)."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        """True on rank 0 (the process that logs and writes checkpoints)."""
        return self.rank == 0


def is_distributed() -> bool:
    """True when a default process group is initialised (``torch.distributed`` available)."""
    return dist.is_available() and dist.is_initialized()


def get_rank(group: dist.ProcessGroup | None = None) -> int:
    """This process's rank in ``group`` (default group when None); 0 without a process group."""
    return dist.get_rank(group) if is_distributed() else 0


def get_world_size(group: dist.ProcessGroup | None = None) -> int:
    """Number of ranks in ``group`` (default group when None); 1 without a process group."""
    return dist.get_world_size(group) if is_distributed() else 1


def _env_int(name: str, default: int | None) -> int:
    raw = os.environ.get(name)
    if raw is None:
        if default is None:
            raise ValueError(f"environment variable {name} is not set; launch with torchrun")
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


def init_distributed(timeout_s: float = DEFAULT_TIMEOUT_S, backend: str | None = None) -> DistInfo:
    """Join the process group described by the torchrun environment and return a :class:`DistInfo`.

    Reads ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` (plus ``MASTER_ADDR``/``MASTER_PORT``
    through PyTorch's ``env://`` rendezvous) once. Without ``WORLD_SIZE`` (a plain ``python``
    launch), or with ``WORLD_SIZE=1``, no group is created and rank 0 of 1 is returned. When a
    default group already exists it is reused (its backend is reported, ``timeout_s`` ignored).

    Backend: ``"nccl"`` with ``torch.cuda.set_device(local_rank)`` when CUDA is available,
    ``"gloo"`` otherwise; ``backend`` overrides the choice. ``timeout_s`` (seconds, > 0) bounds
    every collective on the group (see the module docstring).

    Raises ``ValueError`` for a non-positive timeout, malformed environment variables, a rank
    outside ``[0, WORLD_SIZE)`` or a ``LOCAL_RANK`` with no matching CUDA device.
    """
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s}")
    cuda = torch.cuda.is_available()
    if is_distributed():
        chosen = dist.get_backend()
        local_rank = _env_int("LOCAL_RANK", 0)
        device = torch.device("cuda", local_rank) if chosen == "nccl" else torch.device("cpu")
        return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, device, chosen)
    world_size = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", rank)
    if not 0 <= rank < world_size:
        raise ValueError(f"RANK={rank} is outside [0, WORLD_SIZE={world_size})")
    chosen = backend or ("nccl" if cuda else "gloo")
    if chosen == "nccl":
        if local_rank >= torch.cuda.device_count():
            raise ValueError(
                f"LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} CUDA devices are "
                "visible; start at most one process per GPU (torchrun --nproc-per-node)"
            )
        torch.cuda.set_device(local_rank)
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if world_size == 1:
        return DistInfo(0, 1, local_rank, device, "none")
    dist.init_process_group(
        backend=chosen,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
        device_id=device if chosen == "nccl" else None,
        **_rendezvous(rank, world_size, timeout_s),
    )
    return DistInfo(rank, world_size, local_rank, device, chosen)


def _rendezvous(rank: int, world_size: int, timeout_s: float) -> dict:
    """``init_process_group``'s rendezvous: ``env://``; in a worker group torchrun restarted
    (``TORCHELASTIC_RESTART_COUNT`` > 0) the same store under a prefix of this attempt, so that
    no rank reads a peer address the previous attempt left in torchrun's agent store (gloo then
    connects to a port nobody listens on)."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if attempt in ("", "0"):
        return {"init_method": "env://"}
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=not agent_store and rank == 0, timeout=timedelta(seconds=timeout_s),
                          multi_tenant=not agent_store)
    return {"store": dist.PrefixStore(f"raggedvl/attempt_{attempt}", store)}


def set_collective_timeout(timeout_s: float, group: dist.ProcessGroup | None = None) -> None:
    """Bound every later collective of ``group`` (default group when None) by ``timeout_s``
    seconds, for a group someone else created (accelerate, a test harness). No-op without a
    process group. Uses ``torch.distributed.distributed_c10d._set_pg_timeout`` (private, in
    PyTorch since 2.3: no public way to change an existing group's timeout). Raises
    ``ValueError`` for a non-positive timeout."""
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s}")
    if is_distributed():
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=timeout_s), group)


def shutdown() -> None:
    """Destroy the default process group if one exists (safe to call more than once)."""
    if is_distributed():
        dist.destroy_process_group()

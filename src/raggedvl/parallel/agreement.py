"""Shape agreement before a ragged collective: turn a would-be hang into a readable error.

Shape legend: W ranks; a tensor's leading dim is its row count n_r (may differ per rank).

Every ragged gather first exchanges a fixed-size int64 header per rank (one ``all_gather``,
which it needs anyway to learn the row counts). Because the header has the same size on every
rank, this exchange cannot hang on a shape mismatch; every rank then sees every rank's dtype and
shape and raises the *same* ``ValueError`` listing all of them when they disagree on anything
that must agree (dtype, number of dims, trailing dims that are not allowed to vary). This check
is always on: it costs nothing beyond the count exchange.

Debug mode (``debug=True`` or environment variable ``RAGGEDVL_DEBUG_COLLECTIVES=1``) adds two
fields to the header: a per-process call counter and a CRC32 of a caller-given ``tag``. Ranks
that issue gathers in a different order (one rank skipped a gather, or gathers queries where the
others gather documents) are then reported instead of silently exchanging mismatched tensors.
"""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

DEBUG_ENV = "RAGGEDVL_DEBUG_COLLECTIVES"
MAX_DIMS = 6
_DTYPES = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
)
_FIELDS = 7  # ndim, dtype, debug flag, call index, tag crc, grad enabled, requires grad
_call_counters: dict[int, int] = {}


def debug_enabled(debug: bool | None) -> bool:
    """``debug`` when given, else whether ``RAGGEDVL_DEBUG_COLLECTIVES`` is ``1``/``true``."""
    if debug is not None:
        return bool(debug)
    return os.environ.get(DEBUG_ENV, "").strip().lower() in ("1", "true", "yes")


@dataclass(frozen=True)
class RankShape:
    """What one rank announced: its tensor's ``dtype`` and ``shape`` (plus debug fields)."""

    rank: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    call_index: int
    tag_crc: int
    debug: bool
    grad_enabled: bool = False
    requires_grad: bool = False

    def describe(self) -> str:
        return f"rank {self.rank}: {str(self.dtype).replace('torch.', '')} {list(self.shape)}"


def _encode(x: torch.Tensor, debug: bool, call_index: int, tag: str) -> torch.Tensor:
    if x.dim() > MAX_DIMS or x.dim() == 0:
        raise ValueError(
            f"ragged gather supports tensors with 1..{MAX_DIMS} dims, got shape {list(x.shape)}; "
            "reshape to [rows, ...] first"
        )
    if x.dtype not in _DTYPES:
        raise TypeError(f"ragged gather does not support dtype {x.dtype}")
    grad = torch.is_grad_enabled()
    fields = [x.dim(), _DTYPES.index(x.dtype), int(debug), call_index if debug else 0,
              zlib.crc32(tag.encode()) if debug else 0, int(grad), int(grad and x.requires_grad)]
    fields += list(x.shape) + [-1] * (MAX_DIMS - x.dim())
    return torch.tensor(fields, dtype=torch.int64, device=x.device)


def _decode(rank: int, row: list[int]) -> RankShape:
    ndim, dtype_code, dbg, call_index, crc, grad, req = row[:_FIELDS]
    return RankShape(rank, _DTYPES[dtype_code], tuple(row[_FIELDS:_FIELDS + ndim]), call_index, crc,
                     bool(dbg), bool(grad), bool(req))


def exchange_shapes(
    x: torch.Tensor,
    *,
    varying_dims: tuple[int, ...],
    group: dist.ProcessGroup | None,
    tag: str = "",
    debug: bool | None = None,
) -> list[RankShape]:
    """All-gather every rank's dtype and shape of ``x`` and check that they agree.

    Collectives: one ``all_gather`` of a ``[7 + MAX_DIMS]`` int64 header on ``x.device``
    (no gradient). Dims listed in ``varying_dims`` (always including 0, the row count) may
    differ between ranks; dtype, rank count of dims and every other dim must match, and so must
    grad mode (``torch.is_grad_enabled()``), because a gather's backward is itself a collective.
    Each rank's ``requires_grad`` is reported so that a rank whose own rows need no gradient
    still joins the backward collective of the others.

    Returns the per-rank :class:`RankShape` list, in rank order. Raises ``ValueError`` on every
    rank, listing each rank's dtype and shape (and call index/tag in debug mode), when they
    disagree; ``ValueError``/``TypeError`` before the collective for tensors with 0 or more than
    ``MAX_DIMS`` dims or unsupported dtypes.
    """
    dbg = debug_enabled(debug)
    key = id(group) if group is not None else 0
    call_index = _call_counters.get(key, 0)
    _call_counters[key] = call_index + 1
    header = _encode(x, dbg, call_index, tag)
    world = dist.get_world_size(group)
    buffers = [torch.empty_like(header) for _ in range(world)]
    dist.all_gather(buffers, header, group=group)
    shapes = [_decode(r, b.tolist()) for r, b in enumerate(buffers)]
    _check(shapes, varying_dims, tag)
    return shapes


def _check(shapes: list[RankShape], varying_dims: tuple[int, ...], tag: str) -> None:
    first = shapes[0]
    problems = []
    if any(s.dtype != first.dtype for s in shapes):
        problems.append("dtypes differ")
    if any(s.grad_enabled != first.grad_enabled for s in shapes):
        modes = ", ".join(f"rank {s.rank}: {'on' if s.grad_enabled else 'off'}" for s in shapes)
        problems.append(f"grad mode differs ({modes}): run the loss under no_grad on all ranks or none")
    if any(len(s.shape) != len(first.shape) for s in shapes):
        problems.append("numbers of dims differ")
    else:
        fixed = [d for d in range(len(first.shape)) if d not in varying_dims and d != 0]
        bad = [d for d in fixed if any(s.shape[d] != first.shape[d] for s in shapes)]
        if bad:
            problems.append(f"dims {bad} must be equal on every rank")
    if all(s.debug for s in shapes):
        if any(s.call_index != first.call_index for s in shapes):
            calls = ", ".join(f"rank {s.rank}: call #{s.call_index}" for s in shapes)
            problems.append(f"ranks are at different gathers ({calls}): one rank skipped a gather")
        elif any(s.tag_crc != first.tag_crc for s in shapes):
            problems.append("ranks passed different tags: they gather different tensors")
    if problems:
        listing = "; ".join(s.describe() for s in shapes)
        label = f" '{tag}'" if tag else ""
        raise ValueError(
            f"ragged all-gather{label}: {', '.join(problems)} ({listing}). Every rank must gather "
            "tensors of the same dtype and trailing shape, in the same order; only the row count"
            " (and the token dim of all_gather_padded) may differ."
        )

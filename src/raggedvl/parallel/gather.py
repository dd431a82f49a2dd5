"""Autograd-aware all-gather of ragged tensors (different row counts, and token counts, per rank).

Shape legend: W ranks; rank r holds n_r rows (N = sum_r n_r); multi-vector rows have L_r
vectors (L_max = max_r L_r) of size D. Offsets: offset_r = n_0 + ... + n_{r-1} (the exclusive
cumulative sum of the gathered counts), so rank r's rows are ``gathered[offset_r:offset_r+n_r]``.

Protocol of one gather (both backends, gloo and NCCL):
1. one ``all_gather`` of a fixed-size header (row count, shape, dtype; see
   :mod:`raggedvl.parallel.agreement`), which also checks that ranks agree;
2. each rank zero-pads its tensor to the global maximum shape, one ``all_gather`` into a list of
   W equal buffers (supported by gloo and NCCL for every dtype used here), trimmed to the real
   rows and concatenated in rank order.
Backward: the gradient of the whole gathered tensor ``[N, ...]`` is summed over ranks with one
``all_reduce(SUM)`` and each rank keeps the slice of its own rows: every rank's copy of a row
sends its gradient back to the row's owner. The gathered tensor requires grad on every rank as
soon as one rank's input does (ranks exchange ``requires_grad`` in the header), so every rank
must call backward through the gather (as DDP requires of any forward anyway); ranks must agree
on grad mode (checked). Double backward is not supported.

Fast path: with no process group, world size 1 or ``group`` of size 1, the input is returned as
is (no copy, no collective).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from raggedvl.batch.offsets import exclusive_cumsum
from raggedvl.parallel.agreement import RankShape, exchange_shapes
from raggedvl.parallel.runtime import is_distributed


class VariableGather(NamedTuple):
    """Result of :func:`all_gather_variable`: ``values [N, *rest]``, per-rank row ``counts``
    (list of W ints) and ``offsets`` (exclusive cumulative sum of ``counts``)."""

    values: torch.Tensor
    counts: list[int]
    offsets: list[int]


class PaddedGather(NamedTuple):
    """Result of :func:`all_gather_padded`: ``values [N, L_max, *rest]`` (zeros past each row's
    own length), ``mask [N, L_max]`` bool (True = real vector), ``counts``, ``offsets``."""

    values: torch.Tensor
    mask: torch.Tensor
    counts: list[int]
    offsets: list[int]



def _gather_padded_rows(x: torch.Tensor, shapes: list[RankShape], group) -> torch.Tensor:
    """Pad ``x`` to the elementwise max of ``shapes``, all_gather, keep each rank's real rows."""
    max_shape = [max(s.shape[d] for s in shapes) for d in range(x.dim())]
    if sum(s.shape[0] for s in shapes) == 0:
        return x.new_zeros([0] + max_shape[1:])
    if list(x.shape) == max_shape:
        padded = x.contiguous()
    else:
        padded = x.new_zeros(max_shape)
        padded[tuple(slice(0, n) for n in x.shape)] = x
    buffers = [torch.empty_like(padded) for _ in shapes]
    dist.all_gather(buffers, padded, group=group)
    return torch.cat([buf[: s.shape[0]] for buf, s in zip(buffers, shapes)], dim=0)


class _RaggedAllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, shapes: list[RankShape], group, rank: int):
        ctx.group = group
        ctx.local_shape = tuple(x.shape)
        ctx.offset = sum(s.shape[0] for s in shapes[:rank])
        return _gather_padded_rows(x.detach(), shapes, group)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        if grad.numel() > 0:
            dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        n, *rest = ctx.local_shape
        index = (slice(ctx.offset, ctx.offset + n),) + tuple(slice(0, d) for d in rest)
        return grad[index], None, None, None


def _world(group) -> int:
    return dist.get_world_size(group) if is_distributed() else 1


def _join_backward(x: torch.Tensor, shapes: list[RankShape]) -> torch.Tensor:
    """A rank whose rows need no gradient (e.g. an empty tensor) while another rank's do must
    still run the backward all_reduce: give it a detached leaf that requires grad."""
    if any(s.requires_grad for s in shapes) and not x.requires_grad:
        return x.detach().requires_grad_(True)
    return x


def _check_multi_vector(name: str, x: torch.Tensor, mask: torch.Tensor) -> None:
    """``ValueError`` / ``TypeError`` unless ``x`` is ``[n, L, ...]`` with a bool ``mask [n, L]``."""
    if x.dim() < 3 or tuple(mask.shape) != tuple(x.shape[:2]):
        raise ValueError(f"{name} needs x [n, L, ...] and mask [n, L]; got x {list(x.shape)} and mask {list(mask.shape)}")
    if mask.dtype != torch.bool:
        raise TypeError(f"mask must be bool (True = real vector), got {mask.dtype}")


def all_gather_variable(
    x: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    tag: str = "",
    debug: bool | None = None,
) -> VariableGather:
    """Gather ``x [n_r, *rest]`` from every rank into ``values [N, *rest]``, rank-ordered.

    ``*rest`` and the dtype must be equal on every rank; ``n_r`` may differ (0 included).
    Collectives (forward): one header ``all_gather`` + one data ``all_gather`` (none when all
    ranks hold 0 rows); backward: one ``all_reduce(SUM)`` of the ``[N, *rest]`` gradient, of
    which this rank keeps rows ``offset_r:offset_r+n_r``. Without a process group or at world
    size 1 returns ``(x, [n], [0])`` with no copy. ``tag``/``debug``: see
    :mod:`raggedvl.parallel.agreement`.

    Raises ``ValueError`` on every rank (before the data exchange) when ranks disagree on dtype
    or trailing shape, listing each rank's shape.
    """
    if _world(group) == 1:
        return VariableGather(x, [x.shape[0]], [0])
    shapes = exchange_shapes(x, varying_dims=(0,), group=group, tag=tag, debug=debug)
    counts = [s.shape[0] for s in shapes]
    values = _RaggedAllGather.apply(_join_backward(x, shapes), shapes, group, dist.get_rank(group))
    return VariableGather(values, counts, exclusive_cumsum(counts).tolist())


def all_gather_padded(
    x: torch.Tensor,
    mask: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    tag: str = "",
    debug: bool | None = None,
) -> PaddedGather:
    """Gather multi-vector rows ``x [n_r, L_r, *rest]`` with ``mask [n_r, L_r]`` (bool, True =
    real vector) into ``values [N, L_max, *rest]`` and ``mask [N, L_max]``.

    Rows shorter than ``L_max`` are zero-padded and the pads are False in the returned mask
    (consumers must mask them, never infer them from zeros). ``n_r`` and ``L_r`` may differ per
    rank; dtype and ``*rest`` must not. Collectives (forward): one header ``all_gather``, one
    ``all_gather`` for ``x`` and one for ``mask`` (uint8, no gradient); backward: one
    ``all_reduce(SUM)`` of the ``[N, L_max, *rest]`` gradient, sliced back to
    ``[n_r, L_r, *rest]`` for this rank. Without a process group or at world size 1 returns the
    inputs unchanged.

    Raises ``ValueError`` before any collective when ``mask`` is not ``[n_r, L_r]``, and on
    every rank when ranks disagree on dtype or trailing shape (listing each rank's shape).
    """
    _check_multi_vector("all_gather_padded", x, mask)
    if _world(group) == 1:
        return PaddedGather(x, mask, [x.shape[0]], [0])
    shapes = exchange_shapes(x, varying_dims=(0, 1), group=group, tag=tag, debug=debug)
    counts = [s.shape[0] for s in shapes]
    values = _RaggedAllGather.apply(_join_backward(x, shapes), shapes, group, dist.get_rank(group))
    mask_shapes = [RankShape(s.rank, torch.uint8, s.shape[:2], 0, 0, False) for s in shapes]
    gathered_mask = _gather_padded_rows(mask.to(torch.uint8), mask_shapes, group).bool()
    return PaddedGather(values, gathered_mask, counts, exclusive_cumsum(counts).tolist())


def all_gather_packed(
    x: torch.Tensor,
    mask: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    tag: str = "",
    debug: bool | None = None,
) -> PaddedGather:
    """Gather multi-vector rows ``x [n_r, L_r, *rest]`` with ``mask [n_r, L_r]`` (bool, True =
    real vector) sending only the real vectors; returns ``values [N, V, *rest]`` and ``mask
    [N, V]``, V the most real vectors of any row, each row's real vectors first in their
    original order (a set function of the vectors, such as MaxSim, is unchanged).

    Transport: this rank's real vectors ``x[mask]`` ``[T_r, *rest]`` and its rows' vector counts
    ``[n_r]`` go through :func:`all_gather_variable` (the buffers are padded only to the largest
    rank's T_r, not to ``max n_r x max L_r`` as in :func:`all_gather_padded`); the padded layout
    is rebuilt locally. Collectives (forward): two header ``all_gather`` + two data
    ``all_gather``; backward: one ``all_reduce(SUM)`` of the ``[T, *rest]`` gradient of the
    real vectors (T = sum of T_r), of which this rank keeps its own. Without a process group or
    at world size 1 returns the inputs unchanged.

    Raises ``ValueError`` / ``TypeError`` before any collective for a ``mask`` that is not bool
    ``[n_r, L_r]``, and on every rank when ranks disagree on dtype or trailing shape.
    """
    _check_multi_vector("all_gather_packed", x, mask)
    if _world(group) == 1:
        return PaddedGather(x, mask, [x.shape[0]], [0])
    vectors = all_gather_variable(x[mask], group=group, tag=f"{tag} vectors", debug=debug).values
    lengths = all_gather_variable(mask.sum(dim=1), group=group, tag=f"{tag} lengths", debug=debug)
    longest = int(lengths.values.max()) if lengths.values.numel() else 0
    gathered_mask = torch.arange(longest, device=mask.device) < lengths.values.unsqueeze(1)
    values = vectors.new_zeros((gathered_mask.shape[0], longest, *x.shape[2:]))
    values = values.index_put(torch.nonzero(gathered_mask, as_tuple=True), vectors)
    return PaddedGather(values, gathered_mask, lengths.counts, lengths.offsets)

"""Partition a set of weighted items into W parts minimising the largest part's cost.

Used by the cost-balanced sampler (one global batch -> W ranks) and by ``scatter_batch``
(one batch -> DataParallel replicas). Python + numpy, deterministic (bit-identical on every
rank: see ``refine``), no communication.

Shapes: ``costs`` is a sequence of n non-negative floats (any unit: the cost model's); the
optional ``sizes`` is a sequence of n non-negative numbers in the unit of ``capacity``
(typically vision patches, a memory proxy). The result is a list of W lists of item indices,
each sorted ascending, so samples keep their relative order.

Algorithm (chosen by measurement, see ``benchmarks/results/balance.md``): greedy
longest-processing-time (Graham, 1969, "Bounds on multiprocessing timing anomalies"), then a
vectorised local search (``raggedvl.sampling.refine``) of single-item moves and pairwise swaps
that lower the most loaded parts. LPT alone is within 4/3 - 1/(3W) of optimal; the refinement
closes most of the remaining gap at the batch sizes used here (a few items per part).
"""

from __future__ import annotations

import heapq
from typing import Sequence

import numpy as np

from raggedvl.sampling.refine import DEFAULT_ROUNDS, refine_partition


class PartitionInfeasible(ValueError):
    """Raised when the greedy packer cannot place every item under the per-part ``capacity``."""


def _check_values(name: str, values: Sequence[float]) -> np.ndarray:
    arr = np.asarray(values, dtype=np.float64).reshape(-1)
    bad = np.flatnonzero(~(arr >= 0.0) | np.isinf(arr))
    if len(bad):
        i = int(bad[0])
        raise ValueError(f"item {i} has {name} {values[i]!r}; {name} must be finite and >= 0")
    return arr


def partition_costs(
    costs: Sequence[float],
    num_parts: int,
    *,
    sizes: Sequence[float] | None = None,
    capacity: float | None = None,
    refine_rounds: int = DEFAULT_ROUNDS,
) -> list[list[int]]:
    """Split items ``0..n-1`` into ``num_parts`` lists, minimising the largest summed cost.

    Guarantees: every item in exactly one part; when ``n >= num_parts`` every part holds at
    least one item (a part with no sample is useless to a rank); with ``capacity`` every part's
    summed ``sizes`` is ``<= capacity``. Deterministic: ties go to the part with fewer items,
    then the lower part index; equal costs are ordered by item index. ``refine_rounds`` bounds
    the local search after LPT (0: LPT alone).

    Raises ``ValueError`` if ``num_parts < 1``, a cost or size is negative or not finite, the
    lengths of ``costs`` and ``sizes`` differ, ``capacity`` is given without ``sizes``, or one
    item's size exceeds ``capacity`` (the message names the item). Raises
    ``PartitionInfeasible`` (a ``ValueError``) when the items together cannot be packed under
    ``num_parts`` capacities by first-fit in decreasing cost nor in decreasing size order.
    """
    if num_parts < 1:
        raise ValueError(f"num_parts must be >= 1, got {num_parts}")
    c = _check_values("cost", costs)
    n = len(c)
    s = None
    if capacity is not None:
        if sizes is None:
            raise ValueError("capacity was given without sizes; pass sizes= (e.g. patches per item)")
        s = _check_values("size", sizes)
        if len(s) != n:
            raise ValueError(f"costs has {n} items but sizes has {len(s)}; give one size per item")
        over = np.flatnonzero(s > capacity)
        if len(over):
            i = int(over[0])
            raise ValueError(
                f"item {i} has size {s[i]:g} > capacity {capacity:g}: it fits on no part; "
                f"raise the capacity or lower the item's resolution (max_pixels)"
            )
    index = np.arange(n)
    order = np.lexsort((index, -c)).tolist()
    assign = _greedy(c.tolist(), None if s is None else s.tolist(), capacity, num_parts, order)
    if assign is None and s is not None:
        assign = _greedy(c.tolist(), s.tolist(), capacity, num_parts, np.lexsort((index, -s)).tolist())
    if assign is None:
        raise PartitionInfeasible(
            f"{n} items with total size {s.sum():g} do not fit under {num_parts} parts of "
            f"capacity {capacity:g}; use more parts, fewer items or a larger capacity"
        )
    if refine_rounds > 0 and num_parts > 1 and n > num_parts:
        assign = refine_partition(c, s, capacity, np.asarray(assign), num_parts, refine_rounds).tolist()
    parts: list[list[int]] = [[] for _ in range(num_parts)]
    for i, p in enumerate(assign):
        parts[p].append(i)
    return parts


def _greedy(
    c: list[float], s: list[float] | None, capacity: float | None, num_parts: int, order: list[int]
) -> list[int] | None:
    """LPT: each item (in ``order``) to the least-loaded part that has room. None if one has none."""
    heap = [(0.0, 0, p) for p in range(num_parts)]
    assign = [0] * len(c)
    if s is None:
        for i in order:
            load, count, p = heap[0]
            assign[i] = p
            heapq.heapreplace(heap, (load + c[i], count + 1, p))
        return assign
    room = [capacity] * num_parts
    for i in order:
        skipped = []
        while heap:
            load, count, p = heapq.heappop(heap)
            if s[i] <= room[p]:
                break
            skipped.append((load, count, p))
        else:
            return None
        assign[i] = p
        room[p] -= s[i]
        heapq.heappush(heap, (load + c[i], count + 1, p))
        for entry in skipped:
            heapq.heappush(heap, entry)
    return assign

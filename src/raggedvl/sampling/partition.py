"""Partition a set of weighted items into W parts minimising the largest part's cost.

Used by the cost-balanced sampler (one global batch -> W ranks) and by ``scatter_batch``
(one batch -> DataParallel replicas). Pure Python, deterministic, no communication.

Shapes: ``costs`` is a sequence of n non-negative floats (any unit: the cost model's); the
optional ``sizes`` is a sequence of n non-negative numbers in the unit of ``capacity``
(typically vision patches, a memory proxy). The result is a list of W lists of item indices,
each sorted ascending, so samples keep their relative order.

Algorithm (chosen by measurement, see ``benchmarks/results/balance.md``): greedy
longest-processing-time (Graham, 1969, "Bounds on multiprocessing timing anomalies"), then a
vectorised local search (``raggedvl.sampling.refine``) of single-item moves and pairwise swaps
that lower the most loaded parts. LPT alone is within 4/3 of optimal; the refinement closes
most of the remaining gap at the batch sizes used here (a few items per part).
"""

from __future__ import annotations

import heapq
import math
from typing import Sequence

import numpy as np

from raggedvl.sampling.refine import refine_partition


class PartitionInfeasible(ValueError):
    """Raised when the greedy packer cannot place every item under the per-part ``capacity``."""


def _check_values(name: str, values: Sequence[float]) -> list[float]:
    out = [float(v) for v in values]
    for i, v in enumerate(out):
        if not (v >= 0.0) or math.isinf(v):
            raise ValueError(f"item {i} has {name} {values[i]!r}; {name} must be finite and >= 0")
    return out


def partition_costs(
    costs: Sequence[float],
    num_parts: int,
    *,
    sizes: Sequence[float] | None = None,
    capacity: float | None = None,
    refine: bool = True,
) -> list[list[int]]:
    """Split items ``0..n-1`` into ``num_parts`` lists, minimising the largest summed cost.

    Guarantees: every item in exactly one part; when ``n >= num_parts`` every part holds at
    least one item (a part with no sample is useless to a rank); with ``capacity`` every part's
    summed ``sizes`` is ``<= capacity``. Deterministic: ties go to the part with fewer items,
    then the lower part index; equal costs are ordered by item index.

    Raises ``ValueError`` if ``num_parts < 1``, a cost or size is negative or not finite, the
    lengths of ``costs`` and ``sizes`` differ, ``capacity`` is given without ``sizes``, or one
    item's size exceeds ``capacity`` (the message names the item). Raises
    ``PartitionInfeasible`` (a ``ValueError``) when the items together cannot be packed under
    ``num_parts`` capacities by first-fit in decreasing cost nor in decreasing size order.
    """
    if num_parts < 1:
        raise ValueError(f"num_parts must be >= 1, got {num_parts}")
    c = _check_values("cost", costs)
    s = None
    if capacity is not None:
        if sizes is None:
            raise ValueError("capacity was given without sizes; pass sizes= (e.g. patches per item)")
        s = _check_values("size", sizes)
        if len(s) != len(c):
            raise ValueError(f"costs has {len(c)} items but sizes has {len(s)}; give one size per item")
        for i, v in enumerate(s):
            if v > capacity:
                raise ValueError(
                    f"item {i} has size {v:g} > capacity {capacity:g}: it fits on no part; "
                    f"raise the capacity or lower the item's resolution (max_pixels)"
                )
    order = sorted(range(len(c)), key=lambda i: (-c[i], i))
    assign = _greedy(c, s, capacity, num_parts, order)
    if assign is None and s is not None:
        assign = _greedy(c, s, capacity, num_parts, sorted(range(len(c)), key=lambda i: (-s[i], i)))
    if assign is None:
        raise PartitionInfeasible(
            f"{len(c)} items with total size {sum(s):g} do not fit under {num_parts} parts of "
            f"capacity {capacity:g}; use more parts, fewer items or a larger capacity"
        )
    if refine and num_parts > 1 and len(c) > num_parts:
        sizes_arr = None if s is None else np.asarray(s, dtype=np.float64)
        assign = refine_partition(np.asarray(c, dtype=np.float64), sizes_arr, capacity, np.asarray(assign), num_parts).tolist()
    parts: list[list[int]] = [[] for _ in range(num_parts)]
    for i, p in enumerate(assign):
        parts[p].append(i)
    return parts


def _greedy(
    c: list[float], s: list[float] | None, capacity: float | None, num_parts: int, order: list[int]
) -> list[int] | None:
    """LPT: each item (in ``order``) to the least-loaded part that has room. None if one has none."""
    heap = [(0.0, 0, p) for p in range(num_parts)]
    room = [capacity] * num_parts if s is not None else None
    assign = [0] * len(c)
    for i in order:
        skipped = []
        while heap:
            load, count, p = heapq.heappop(heap)
            if room is None or s[i] <= room[p]:
                break
            skipped.append((load, count, p))
        else:
            return None
        assign[i] = p
        if room is not None:
            room[p] -= s[i]
        heapq.heappush(heap, (load + c[i], count + 1, p))
        for entry in skipped:
            heapq.heappush(heap, entry)
    return assign

"""Partition a set of weighted items into W parts minimising the largest part's cost.

Used by the cost-balanced sampler (one global batch -> W ranks) and by ``scatter_batch``
(one batch -> DataParallel replicas). Pure Python, deterministic, no communication.

Shapes: ``costs`` is a sequence of n non-negative floats; the result is a list of W lists of
item indices (each list sorted ascending, so samples keep their relative order).
"""

from __future__ import annotations

import heapq
from typing import Sequence


def partition_costs(costs: Sequence[float], num_parts: int) -> list[list[int]]:
    """Greedy longest-processing-time partition (Graham, 1969): items in decreasing cost go to
    the currently cheapest part (ties: lowest part index, then lowest item index).

    Raises ``ValueError`` if ``num_parts < 1`` or a cost is negative or not finite.
    """
    if num_parts < 1:
        raise ValueError(f"num_parts must be >= 1, got {num_parts}")
    for i, c in enumerate(costs):
        if not (c >= 0.0) or c == float("inf"):
            raise ValueError(f"item {i} has cost {c!r}; costs must be finite and >= 0")
    order = sorted(range(len(costs)), key=lambda i: (-costs[i], i))
    heap = [(0.0, p) for p in range(num_parts)]
    parts: list[list[int]] = [[] for _ in range(num_parts)]
    for i in order:
        load, p = heapq.heappop(heap)
        parts[p].append(i)
        heapq.heappush(heap, (load + costs[i], p))
    for part in parts:
        part.sort()
    return parts

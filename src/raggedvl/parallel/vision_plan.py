"""Encoder rebalancing plan: which rank runs the vision tower on which image (pure, no collective).

Shape legend: W ranks; rank r owns I_r images (its documents' images, in batch order); image
(r, i) has tower cost c_ri (any unit, e.g. :meth:`raggedvl.batch.CostModel.image_costs`).

The cost-balanced sampler balances each rank's WHOLE step (tower + language model). With few
samples per rank, or one huge image among thumbnails, a rank's vision-tower share can still
exceed the mean tower load (1/W of the total) by far. Images are independent in the tower
(attention stays inside each image), so whole images can be encoded on another rank and the
features sent back (:mod:`raggedvl.parallel.vision_rebalance`).

:func:`plan_vision_balance` decides, from every rank's image costs, deterministically (every
rank computes the same plan from the same gathered costs):

1. ``cap = max(mean tower load, largest single image)`` (no assignment of whole images can
   have a smaller maximum); with no rank above ``cap * (1 + tolerance)`` nothing moves;
2. each rank keeps its own images, largest first, while its kept load stays <= ``cap``
   (first fit: a too-large image is skipped, smaller ones still fit); the rest form a pool;
3. pool images, largest first (ties: owner, index), go to the rank with the least load so far
   (ties: lowest rank), the LPT rule (Graham 1969);
4. if that does not lower the largest load, nothing moves.

So a rank above its fair share hands off its smallest images that do not fit; a rank at or
below ``cap`` keeps everything, and images move only towards less loaded ranks.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Sequence

DEFAULT_TOLERANCE = 0.05  # moving images for a smaller gain costs an exchange and a sync point for little


@dataclass(frozen=True)
class VisionPlan:
    """Where each image is encoded.

    ``assignment[r][i]``: the rank that runs the tower on rank r's image i.
    ``costs[r][i]``: its cost, as given. ``loads_before`` / ``loads_after``: per-rank tower
    load without / with the plan (W floats).
    """

    assignment: tuple[tuple[int, ...], ...]
    costs: tuple[tuple[float, ...], ...]
    loads_before: tuple[float, ...]
    loads_after: tuple[float, ...]

    @property
    def world_size(self) -> int:
        return len(self.assignment)

    @property
    def moved(self) -> int:
        """Images encoded on a rank other than their owner."""
        return sum(c != r for r, row in enumerate(self.assignment) for c in row)

    @property
    def max_over_mean_before(self) -> float:
        return _max_over_mean(self.loads_before)

    @property
    def max_over_mean_after(self) -> float:
        return _max_over_mean(self.loads_after)

    def computed_by(self, rank: int) -> list[tuple[int, int]]:
        """The images ``rank`` encodes, as (owner, index), in the transport's order: by owner,
        then index."""
        return [(r, i) for r, row in enumerate(self.assignment) for i, c in enumerate(row) if c == rank]

    def sent_by(self, rank: int) -> list[int]:
        """Indices of ``rank``'s own images in the order it sends them: by destination rank,
        then index (its kept images sit at their own rank's place)."""
        row = self.assignment[rank]
        return sorted(range(len(row)), key=lambda i: (row[i], i))


def _max_over_mean(loads: Sequence[float]) -> float:
    total = sum(loads)
    return max(loads) * len(loads) / total if total > 0 else 1.0


def plan_vision_balance(costs: Sequence[Sequence[float]], *, tolerance: float = 0.0) -> VisionPlan:
    """Plan where each image runs the vision tower (module docstring).

    ``costs[r]``: the tower costs of rank r's images, in order (floats >= 0; a rank may have
    none). ``tolerance``: leave the owners as they are while the largest rank load is within
    ``cap * (1 + tolerance)``. Raises ``ValueError`` for no ranks, a negative or non-finite
    cost or a negative tolerance.
    """
    if not costs:
        raise ValueError("plan_vision_balance needs the image costs of at least one rank")
    if not tolerance >= 0:
        raise ValueError(f"tolerance must be >= 0, got {tolerance}")
    rows = tuple(tuple(float(c) for c in row) for row in costs)
    for r, row in enumerate(rows):
        bad = [(i, c) for i, c in enumerate(row) if not 0 <= c < float("inf")]
        if bad:
            raise ValueError(f"rank {r}'s image costs must be finite and >= 0; image {bad[0][0]} has {bad[0][1]}")
    world = len(rows)
    before = tuple(sum(row) for row in rows)
    owners = tuple(tuple(r for _ in row) for r, row in enumerate(rows))
    unchanged = VisionPlan(owners, rows, before, before)
    total = sum(before)
    if world == 1 or total == 0:
        return unchanged
    cap = max(total / world, max(c for row in rows for c in row))
    if max(before) <= cap * (1 + tolerance):
        return unchanged
    assignment = [list(row) for row in owners]
    loads = [0.0] * world
    pool: list[tuple[float, int, int]] = []
    for r, row in enumerate(rows):
        for i in sorted(range(len(row)), key=lambda i: (-row[i], i)):
            if loads[r] + row[i] <= cap:
                loads[r] += row[i]
            else:
                pool.append((row[i], r, i))
    heap = [(load, r) for r, load in enumerate(loads)]
    heapq.heapify(heap)
    for cost, owner, index in sorted(pool, key=lambda x: (-x[0], x[1], x[2])):
        load, r = heapq.heappop(heap)
        assignment[owner][index] = r
        loads[r] = load + cost
        heapq.heappush(heap, (loads[r], r))
    if max(loads) >= max(before):
        return unchanged
    return VisionPlan(tuple(tuple(row) for row in assignment), rows, before, tuple(loads))

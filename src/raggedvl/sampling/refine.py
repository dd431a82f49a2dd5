"""Vectorised local search that lowers the most loaded part of a partition.

Shapes: n items, W parts, K slots per part (most items in a part plus slack for moves). The
partition is held as matrices ``cost_WK`` (a huge sentinel in empty slots, so that any
exchange involving one scores as invalid), ``size_WK`` (0 in empty slots) and ``item_WK`` (-1
in empty slots), with ``load_W``, ``used_W`` and ``count_W``.

An exchange between a heavier part h and a lighter part l (gap g = load[h] - load[l] > 0)
moves one item a from h to l, or swaps a with an item b of l; it transfers d = c[a] - c[b]
(c[b] = 0 for a move) and lowers the pair's maximum iff 0 < d < g, i.e. iff the score
|d - g/2| - g/2 is negative; the new pair maximum is load[h] + score, lowest is best.
Each round, the few heaviest parts (heaviest first) each take the exchange that leaves the
lowest pair maximum with a partner not yet used in that round; all chosen exchanges involve
disjoint parts and are applied at once. Partners are first the lighter half of the parts (cheap)
and, once no exchange helps the heaviest part there, every part; when that fails too the
partition is a local optimum and the search stops (also at the lower bound, or after a fixed
number of rounds). Chosen by measurement against LPT alone and other variants: see
``benchmarks/results/balance.md``.

Only element-wise float operations and exact comparisons are used (no reductions whose order
could depend on the CPU's vector width), so every rank computes bit-identical partitions.
Moves never empty a part and every exchange keeps each part's summed size within capacity.
"""

from __future__ import annotations

import math

import numpy as np

# Default rounds of exchanges per partition: on rdocs at G=256, W=64 the gain flattens after a
# few rounds while each round costs about as much as LPT itself (results/balance.md).
DEFAULT_ROUNDS = 4
# How many of the heaviest parts look for an exchange partner per round.
_TOP_PARTS = 4
# Stop once the largest part is within this relative distance of the lower bound
# max(mean part cost, largest item): no partition can beat the bound.
_LOWER_BOUND_RTOL = 1e-3
_EMPTY = 1e300


class _Parts:
    """The partition as slot matrices; column K of ``cost``/``size`` is a permanent 0 (the
    "no item" side of a move)."""

    def __init__(self, c: np.ndarray, s: np.ndarray, assign: np.ndarray, num_parts: int, capacity: float) -> None:
        self.count = np.bincount(assign, minlength=num_parts)
        self.k = k = int(self.count.max()) + 2
        order = np.argsort(assign, kind="stable")
        starts = np.concatenate([[0], np.cumsum(self.count)[:-1]])
        rows = assign[order]
        slot = np.arange(len(c)) - starts[rows]
        self.cost = np.full((num_parts, k + 1), _EMPTY)
        self.cost[:, k] = 0.0
        self.size = np.zeros((num_parts, k + 1))
        self.item = np.full((num_parts, k), -1, dtype=np.int64)
        self.cost[rows, slot] = c[order]
        self.size[rows, slot] = s[order]
        self.item[rows, slot] = order
        self.load = np.bincount(assign, weights=c, minlength=num_parts)
        self.used = np.bincount(assign, weights=s, minlength=num_parts)
        self.capacity = capacity

    def best(self, h: np.ndarray, l: np.ndarray):
        """Best exchange per pair (h[p], l[p]): (transfer d, slot in h, slot in l or K = move,
        score; score < 0 iff the exchange lowers the pair's maximum, to load[h] + score)."""
        p, k = len(h), self.k
        half_gap = ((self.load[h] - self.load[l]) / 2.0)[:, None, None]
        d = self.cost[h, :k][:, :, None] - self.cost[l][:, None, :]
        score = np.abs(d - half_gap) - half_gap
        score[:, :, k] += np.where((self.count[h] > 1) & (self.count[l] < k), 0.0, np.inf)[:, None]
        if self.capacity != np.inf:
            ds = self.size[h, :k][:, :, None] - self.size[l][:, None, :]
            fits = (self.used[l][:, None, None] + ds <= self.capacity) & (self.used[h][:, None, None] - ds <= self.capacity)
            score[~fits] = np.inf
        score = score.reshape(p, -1)
        flat = score.argmin(axis=1)
        rows = np.arange(p)
        return d.reshape(p, -1)[rows, flat], flat // (k + 1), flat % (k + 1), score[rows, flat]

    def apply(self, h: np.ndarray, l: np.ndarray, d: np.ndarray, ia: np.ndarray, ib: np.ndarray) -> None:
        """Apply exchanges on disjoint pairs of parts (``ib == K`` marks a move); a handful per
        round, so scalar updates beat fancy indexing here."""
        cost, size, item, k = self.cost, self.size, self.item, self.k
        for hp, lp, dd, a, b in zip(h.tolist(), l.tolist(), d.tolist(), ia.tolist(), ib.tolist()):
            if b == k:  # move a into the first free slot of lp
                b = int(np.argmax(item[lp] < 0))
                self.count[hp] -= 1
                self.count[lp] += 1
            ds = size[hp, a] - size[lp, b]
            cost[hp, a], cost[lp, b] = cost[lp, b], cost[hp, a]
            size[hp, a], size[lp, b] = size[lp, b], size[hp, a]
            item[hp, a], item[lp, b] = item[lp, b], item[hp, a]
            self.load[hp] -= dd
            self.load[lp] += dd
            self.used[hp] -= ds
            self.used[lp] += ds


def refine_partition(
    costs: np.ndarray,
    sizes: np.ndarray | None,
    capacity: float | None,
    assign: np.ndarray,
    num_parts: int,
    max_rounds: int = DEFAULT_ROUNDS,
) -> np.ndarray:
    """Improved copy of ``assign`` [n] (part of each item) after at most ``max_rounds`` rounds;
    see the module docstring."""
    s = np.zeros_like(costs) if sizes is None else sizes
    parts = _Parts(costs, s, assign, num_parts, np.inf if capacity is None else float(capacity))
    bound = max(math.fsum(costs.tolist()) / num_parts, float(costs.max())) * (1.0 + _LOWER_BOUND_RTOL)
    half = max(1, num_parts // 2)
    tops = min(_TOP_PARTS, num_parts - 1)
    wide = False  # first the lighter half as partners (cheap), then every part
    for _ in range(max_rounds):
        order = np.argsort(parts.load, kind="stable")
        if parts.load[order[-1]] <= bound:
            break
        partners = order[: num_parts - 1] if wide else order[:half]
        if not _apply_top_exchanges(parts, order[: num_parts - tops - 1 : -1], partners):
            if wide:
                break
            wide = True
    out = np.empty(len(costs), dtype=np.int64)
    filled = parts.item >= 0
    out[parts.item[filled]] = np.nonzero(filled)[0]
    return out


def _apply_top_exchanges(parts: _Parts, tops: np.ndarray, partners: np.ndarray) -> bool:
    """Each of the heaviest parts ``tops`` (heaviest first) takes its best exchange with a
    part of ``partners`` not yet used this round (lowest resulting pair maximum); returns False
    if the heaviest part has none."""
    w = len(partners)
    h = np.repeat(tops, w)
    l = np.tile(partners, len(tops))
    d, ia, ib, score = parts.best(h, l)
    score = score.reshape(len(tops), w)
    ranked = np.argsort(score, axis=1, kind="stable")
    ranked_score = np.take_along_axis(score, ranked, axis=1)
    partner_ids = partners.tolist()
    used: set[int] = set()
    picked = []
    for r, top in enumerate(tops.tolist()):
        if top in used:
            continue
        for j, value in zip(ranked[r].tolist(), ranked_score[r].tolist()):
            if not value < 0.0:
                break
            if partner_ids[j] not in used:
                picked.append(r * w + j)
                used.update((top, partner_ids[j]))
                break
        if r == 0 and not picked:
            return False
    sel = np.array(picked)
    parts.apply(h[sel], l[sel], d[sel], ia[sel], ib[sel])
    return True

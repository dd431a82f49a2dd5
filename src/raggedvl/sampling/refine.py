"""Vectorised local search that lowers the most loaded part of a partition.

Shapes: n items, W parts, K slots per part (most items in a part plus slack for moves). The
partition is held as matrices ``cost_WK`` (NaN in empty slots), ``size_WK`` (0 in empty
slots) and ``item_WK`` (-1 in empty slots), with ``load_W``, ``used_W`` and ``count_W``.

An exchange between a heavier part h and a lighter part l (gap g = load[h] - load[l] > 0)
moves one item a from h to l, or swaps a with an item b of l; it transfers d = c[a] - c[b]
(c[b] = 0 for a move) and lowers the pair's maximum iff 0 < d < g, best when d is nearest g/2.
Each round first pairs the i-th heaviest part with the i-th lightest and applies every pair's
best exchange at once (the pairs are disjoint); when no pair improves, it searches the heaviest
part against every other part and applies the single exchange that leaves the lowest pair
maximum; when that fails too the partition is a local optimum and the search stops.

Only element-wise float operations and exact comparisons are used (no reductions whose order
could depend on the CPU's vector width), so every rank computes bit-identical partitions.
Moves never empty a part and every exchange keeps each part's summed size within capacity.
"""

from __future__ import annotations

import math

import numpy as np

_MAX_ROUNDS = 256
# Stop once the largest part is within this relative distance of the lower bound
# max(mean part cost, largest item): no partition can beat the bound.
_LOWER_BOUND_RTOL = 1e-4


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
        self.cost = np.full((num_parts, k + 1), np.nan)
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
        error |d - gap/2|, inf where no exchange lowers the pair's maximum)."""
        p, k = len(h), self.k
        gap = (self.load[h] - self.load[l])[:, None, None]
        d = self.cost[h, :k][:, :, None] - self.cost[l][:, None, :]
        ok = (d > 0.0) & (d < gap)  # NaN (empty slot) compares False
        ok[:, :, k] &= ((self.count[h] > 1) & (self.count[l] < k))[:, None]
        if self.capacity != np.inf:
            ds = self.size[h, :k][:, :, None] - self.size[l][:, None, :]
            ok &= (self.used[l][:, None, None] + ds <= self.capacity) & (self.used[h][:, None, None] - ds <= self.capacity)
        err = np.where(ok, np.abs(d - gap / 2.0), np.inf).reshape(p, -1)
        flat = err.argmin(axis=1)
        rows = np.arange(p)
        return d.reshape(p, -1)[rows, flat], flat // (k + 1), flat % (k + 1), err[rows, flat]

    def apply(self, h: np.ndarray, l: np.ndarray, d: np.ndarray, ia: np.ndarray, ib: np.ndarray) -> None:
        """Apply exchanges on disjoint pairs of parts (``ib == K`` marks a move)."""
        k = self.k
        swap = ib < k
        ds = self.size[h, ia] - self.size[l, ib]
        if swap.any():
            hs, ls, ias, ibs = h[swap], l[swap], ia[swap], ib[swap]
            for mat in (self.cost, self.size, self.item):
                held = mat[hs, ias].copy()
                mat[hs, ias] = mat[ls, ibs]
                mat[ls, ibs] = held
        if not swap.all():
            hm, lm, iam = h[~swap], l[~swap], ia[~swap]
            free = np.argmax(self.item[lm] < 0, axis=1)
            for mat, empty in ((self.cost, np.nan), (self.size, 0.0), (self.item, -1)):
                mat[lm, free] = mat[hm, iam]
                mat[hm, iam] = empty
            self.count[hm] -= 1
            self.count[lm] += 1
        self.load[h] -= d
        self.load[l] += d
        self.used[h] -= ds
        self.used[l] += ds


def refine_partition(
    costs: np.ndarray, sizes: np.ndarray | None, capacity: float | None, assign: np.ndarray, num_parts: int
) -> np.ndarray:
    """Improved copy of ``assign`` [n] (part of each item); see the module docstring."""
    s = np.zeros_like(costs) if sizes is None else sizes
    parts = _Parts(costs, s, assign, num_parts, np.inf if capacity is None else float(capacity))
    bound = max(math.fsum(costs.tolist()) / num_parts, float(costs.max())) * (1.0 + _LOWER_BOUND_RTOL)
    half = num_parts // 2
    everyone = np.arange(num_parts)
    paired = True
    for _ in range(_MAX_ROUNDS):
        order = np.argsort(parts.load, kind="stable")
        top = order[-1]
        if parts.load[top] <= bound:
            break
        if paired:
            h, l = order[: num_parts - half - 1 : -1], order[:half]
            d, ia, ib, err = parts.best(h, l)
            ok = err < np.inf
            if ok.any():
                parts.apply(h[ok], l[ok], d[ok], ia[ok], ib[ok])
                continue
            paired = False  # from here on only the heaviest part searches all partners
        l = everyone[everyone != top]
        d, ia, ib, err = parts.best(np.full(len(l), top), l)
        j = int(np.argmin((parts.load[top] + parts.load[l]) / 2.0 + err))
        if err[j] == np.inf:
            break
        parts.apply(np.array([top]), l[j : j + 1], d[j : j + 1], ia[j : j + 1], ib[j : j + 1])
    out = np.empty(len(costs), dtype=np.int64)
    filled = parts.item >= 0
    out[parts.item[filled]] = np.nonzero(filled)[0]
    return out

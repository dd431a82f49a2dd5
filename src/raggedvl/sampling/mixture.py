"""Weighted mixing of several training datasets (sources) into one epoch (seeded, resumable).

The datasets are concatenated (dataset d holds the global indices ``offset_d .. offset_d +
size_d - 1``) and an epoch of the mixture has N = sum_d size_d draws, like an epoch of the
concatenation. Draw j of epoch e picks its dataset with probability ``weights[d]`` (numpy's
``Generator.choice`` on ``PCG64(SeedSequence([seed, e, 2]))``); the draws of dataset d take its
rows in the order of seeded permutations (``SeedSequence([seed, e, 3, d, round])``): every row
once before any row repeats, then a fresh permutation (an up-weighted small dataset cycles, a
down-weighted large one is only partly seen in an epoch). The order is a pure function of
(sizes, weights, seed, epoch): every rank computes the same one without communication, and a
resumed sampler (epoch, step) replays exactly the draws of an uninterrupted run.

Expected share of dataset d in any window of n draws: ``weights[d] * n``, with binomial spread
``sqrt(n * w_d * (1 - w_d))``. Given the global batch size G, no row occurs twice in one global
batch (draws ``[i*G, (i+1)*G)``: where a batch spans the end of one permutation round, the rows it
already holds move to the end of the next round) unless its dataset has fewer rows than its draws
in that batch; the epoch's last batch, enlarged by a remainder of fewer than W draws, may repeat
one of the remainder's rows.

One-source global batches (``one_source=True``): instead of drawing each sample's dataset,
global batch k of epoch e draws ONE source with probability ``weights[d]`` (numpy's
``Generator.choice`` on ``PCG64(SeedSequence([seed, e, 4, k]))``: a pure function of (seed,
epoch, k), whatever the world size) and takes all its samples from it: ``min(G, size_d)`` rows
of d's seeded permutation rounds (the same rounds as above; the held rows of a batch wait for
the next round, so no row occurs twice in a global batch). Every in-batch negative of a step
then comes from the query's own source (typically harder to tell apart than pages of other sources).
Expected share of source d among an epoch's S batches: ``weights[d] * S``, binomial spread
``sqrt(S * w_d * (1 - w_d))``.

Shapes: D datasets; ``sizes`` [D] ints; ``weights`` [D] floats >= 0 (normalised to sum 1);
an order is [N] int64 global indices.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np


@dataclass(frozen=True)
class Mixture:
    """Sizes and normalised weights of the mixed datasets (build with :meth:`from_weights`)."""

    sizes: tuple[int, ...]
    weights: tuple[float, ...]
    one_source: bool = False  # each global batch from one source (module docstring)
    names: tuple[str, ...] = field(default=(), compare=False)  # the sources' names (messages, metrics)

    @classmethod
    def from_weights(cls, sizes: Sequence[int], weights: Sequence[float], names: Sequence[str] | None = None,
                     one_source: bool = False) -> "Mixture":
        """Validate and normalise. Raises ``ValueError`` for a count mismatch, a negative or
        non-finite weight, all-zero weights, or a dataset with a positive weight and no rows
        (``names`` label the datasets in messages and are kept as :attr:`names`)."""
        sizes, weights = [int(s) for s in sizes], [float(w) for w in weights]
        names = list(names) if names is not None else [f"dataset {d}" for d in range(len(sizes))]
        if len(weights) != len(sizes):
            raise ValueError(f"{len(weights)} weights {weights} for {len(sizes)} datasets {names}; give one weight per dataset")
        for name, w in zip(names, weights):
            if not (w >= 0 and np.isfinite(w)):
                raise ValueError(f"weight {w!r} of {name} must be finite and >= 0")
        total = sum(weights)
        if not total > 0:
            raise ValueError(f"the weights {weights} are all 0; give at least one dataset a positive weight")
        for name, size, w in zip(names, sizes, weights):
            if w > 0 and size < 1:
                raise ValueError(f"{name} has weight {w:g} but no rows; give it rows or weight 0")
        return cls(tuple(sizes), tuple(w / total for w in weights), bool(one_source), tuple(str(n) for n in names))

    @property
    def num_samples(self) -> int:
        return sum(self.sizes)

    def offsets(self) -> np.ndarray:
        """[D] first global index of each dataset."""
        return np.concatenate([[0], np.cumsum(self.sizes)[:-1]]).astype(np.int64)

    def labels(self, seed: int, epoch: int) -> np.ndarray:
        """[N] int64: the dataset of each draw of the epoch."""
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(seed), int(epoch), 2])))
        return rng.choice(len(self.sizes), size=self.num_samples, p=np.asarray(self.weights))

    def order(self, seed: int, epoch: int, batch_size: int | None = None) -> np.ndarray:
        """[N] int64 global sample indices of the epoch's draws (module docstring); with
        ``batch_size`` G, a row repeats inside a window of G draws only when unavoidable."""
        labels = self.labels(seed, epoch)
        order = np.empty(len(labels), dtype=np.int64)
        for d, (size, offset) in enumerate(zip(self.sizes, self.offsets())):
            slots = np.flatnonzero(labels == d)
            if len(slots):
                windows = slots // batch_size if batch_size else np.zeros(len(slots), dtype=np.int64)
                order[slots] = self._rows(seed, epoch, d, size, windows) + offset
        return order

    @staticmethod
    def _rows(seed: int, epoch: int, d: int, size: int, windows: np.ndarray) -> np.ndarray:
        """Dataset d's rows for its draws, whose global batches are ``windows``: seeded
        permutation rounds; a new round puts the rows the current batch already holds last."""
        out = np.empty(len(windows), dtype=np.int64)
        perm, at, rounds, held, current = np.empty(0, dtype=np.int64), 0, 0, set(), -1
        for j, window in enumerate(windows.tolist()):
            if window != current:
                current, held = window, set()
            if at == len(perm):
                rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(seed), int(epoch), 3, d, rounds])))
                perm = rng.permutation(size)
                if held and len(held) < size:
                    late = np.isin(perm, list(held))
                    perm = np.concatenate([perm[~late], perm[late]])
                at, rounds = 0, rounds + 1
            out[j] = perm[at]
            held.add(int(perm[at]))
            at += 1
        return out

    def name(self, d: int) -> str:
        """Source ``d``'s name (``"dataset d"`` when the mixture was built without names)."""
        return self.names[d] if d < len(self.names) else f"dataset {d}"

    def batch_source(self, seed: int, epoch: int, batch: int) -> int:
        """The source of global batch ``batch`` of the epoch under ``one_source`` (module docstring)."""
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(seed), int(epoch), 4, int(batch)])))
        return int(rng.choice(len(self.sizes), p=np.asarray(self.weights)))

    def one_source_batches(self, seed: int, epoch: int, num_batches: int, batch_size: int) -> list[np.ndarray]:
        """The epoch's ``num_batches`` one-source global batches: batch k holds ``min(batch_size,
        size_d)`` global indices of its source d = :meth:`batch_source` (module docstring)."""
        sources = [self.batch_source(seed, epoch, k) for k in range(num_batches)]
        counts = [min(int(batch_size), self.sizes[d]) for d in sources]
        batches = [np.empty(c, dtype=np.int64) for c in counts]
        for d, (size, offset) in enumerate(zip(self.sizes, self.offsets())):
            mine = [k for k, s in enumerate(sources) if s == d]
            if not mine:
                continue
            windows = np.repeat(np.asarray(mine, dtype=np.int64), [counts[k] for k in mine])
            rows = self._rows(seed, epoch, d, size, windows) + offset
            starts = np.concatenate([[0], np.cumsum([counts[k] for k in mine])])
            for j, k in enumerate(mine):
                batches[k] = rows[starts[j] : starts[j + 1]]
        return batches

    def source_of(self, index: int) -> int:
        """The source holding global index ``index``."""
        return int(np.searchsorted(self.offsets(), index, side="right") - 1)

    def state(self) -> dict[str, Any]:
        """JSON-serialisable description (part of a sampler's resume fingerprint); ``one_source``
        appears only when set."""
        state: dict[str, Any] = {"sizes": list(self.sizes), "weights": [round(w, 12) for w in self.weights]}
        if self.one_source:
            state["one_source"] = True
        return state

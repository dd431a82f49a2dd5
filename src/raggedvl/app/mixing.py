"""The sources a training run's sampler draws from: several ``--dataset``s, or the values of
``--source-column`` within one dataset, with their weights.

A source is a set of training rows: the rows of one dataset (datasets concatenated in order),
or the rows of the one dataset whose ``source_column`` holds the same value (sources named by
their values, sorted as text). Weights, normalised to sum 1 by :class:`raggedvl.sampling.Mixture`:

- several datasets: ``dataset_weights``, one per dataset, in order;
- ``source_column``: ``dataset_weights``, one per value of the column, in the sources' (sorted) order;
- neither given: mixed batches draw every row with equal probability (a plain permutation, no
  mixture); one-source batches draw source d with probability proportional to its rows
  (kept rows_d / kept rows), which is what a row drawn uniformly at random would pick.

A row the size estimate rejected (``SampleCosts.skipped``) belongs to no source's count and is
never drawn. The sampler sees the kept rows source after source (``positions``), so each source
is one contiguous run of its sample positions, as the mixture expects.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from raggedvl.sampling import Mixture, SampleCosts
from raggedvl.app.config import TrainConfig


@dataclass(frozen=True)
class TrainingSources:
    """``names`` [D]; ``rows`` [D] rows of each source in the training set; ``kept`` [D] of them
    the size estimate kept; ``positions`` [sum kept] the kept rows (training-set indices), source
    after source, ascending within a source; ``weights`` [D] as given, or None (module docstring)."""

    names: list[str]
    rows: list[int]
    kept: list[int]
    positions: np.ndarray
    weights: list[float] | None


def training_sources(cfg: TrainConfig, costs: SampleCosts, dataset_sizes: Sequence[int] | None = None,
                     row_sources: Sequence[str] | None = None) -> TrainingSources | None:
    """The run's sources (module docstring), or None for one dataset without ``source_column``.

    ``dataset_sizes``: rows of each dataset, in order (``RetrievalDataset.part_sizes``);
    ``row_sources``: each training row's ``source_column`` value (``RetrievalDataset.records``'
    ``"source_value"``). Raises ``ValueError`` when ``dataset_weights`` does not give one weight
    per value of ``source_column`` (naming the values, in order, and their rows)."""
    n_all = len(costs.costs)
    kept = costs.kept()
    if cfg.source_column is not None:
        if row_sources is None or len(row_sources) != n_all:
            raise ValueError(f"source_column {cfg.source_column!r} needs one source value per training row "
                             f"({n_all}); load the training set with source_column")
        values = np.asarray([str(v) for v in row_sources], dtype=object)
        names = sorted(set(values.tolist()))
        index = {name: d for d, name in enumerate(names)}
        labels_all = np.asarray([index[v] for v in values.tolist()], dtype=np.int64).reshape(-1)
        labels = labels_all[kept]
        positions = kept[np.argsort(labels, kind="stable")]
        rows = np.bincount(labels_all, minlength=len(names)).tolist()
        kept_sizes = np.bincount(labels, minlength=len(names)).tolist()
        cfg.check_source_weights(names, rows)
        return TrainingSources(names, rows, kept_sizes, positions, cfg.dataset_weights)
    if len(cfg.datasets) > 1:
        sizes = list(dataset_sizes or [n_all])
        kept_sizes = np.diff(np.searchsorted(kept, np.cumsum(sizes), side="left"), prepend=0).tolist()
        return TrainingSources([str(d) for d in cfg.datasets], sizes, kept_sizes, kept, cfg.dataset_weights)
    return None


def sources_mixture(cfg: TrainConfig, sources: TrainingSources | None) -> Mixture | None:
    """The sampler's mixture: with one-source batches always (default weights: each source's
    kept rows), with mixed batches only when weights are given (else None: a plain permutation).
    Raises ``ValueError`` for a source with a positive weight whose every row was rejected."""
    one_source = cfg.batch_sampling == "one-source"
    if sources is None or (sources.weights is None and not one_source):
        return None
    weights = sources.weights if sources.weights is not None else [float(k) for k in sources.kept]
    for name, size, left, w in zip(sources.names, sources.rows, sources.kept, weights):
        if w > 0 and size > 0 and left == 0:
            which = "its one pair" if size == 1 else f"all its {size} pairs"
            raise ValueError(f"{name} has weight {w:g} but the size estimate rejected {which} "
                             "(unreadable images, warned above); fix its images or give it weight 0")
    return Mixture.from_weights(sources.kept, weights, names=sources.names, one_source=one_source)

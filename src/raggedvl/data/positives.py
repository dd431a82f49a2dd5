"""Which of a query's positives it trains against in an epoch.

A training row may hold several positive images (a list in its image column, see
:class:`raggedvl.data.dataset.RetrievalDataset`). In each epoch the query is paired with one of
them, its drawn positive; the others are its further relevant documents (their keys are masked
from its candidates, :mod:`raggedvl.losses.modules`). ``"first"`` always draws positive 0;
``"random"`` draws uniformly from ``(seed, epoch, row)`` by a hash, with no RNG state, so the
draw is the same on every rank, in every data worker and after a resume.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

POSITIVE_SAMPLING = ("first", "random")


def drawn_positive(count: int, sampling: str, *, seed: int, epoch: int, row: int) -> int:
    """The index in ``[0, count)`` of the positive that row ``row`` trains against in ``epoch``.
    Raises ``ValueError`` for an unknown ``sampling`` or a row without positives."""
    if sampling not in POSITIVE_SAMPLING:
        raise ValueError(f"positive sampling must be one of {POSITIVE_SAMPLING}, got {sampling!r}")
    if count < 1:
        raise ValueError(f"row {row} has {count} positives; every row needs at least one")
    if sampling == "first" or count == 1:
        return 0
    digest = hashlib.blake2b(f"{seed}:{epoch}:{row}".encode(), digest_size=8, person=b"raggedvl-draw").digest()
    return int.from_bytes(digest, "little") % count


class EpochPositives(Sequence):
    """The items of ``dataset`` (a ``RetrievalDataset``) indexed by ``(row, epoch)``: row ``row``
    with the positive :func:`drawn_positive` picks for that epoch (``RetrievalDataset.item``)."""

    def __init__(self, dataset, sampling: str, seed: int) -> None:
        drawn_positive(1, sampling, seed=seed, epoch=0, row=0)  # checks the name
        self.dataset, self.sampling, self.seed = dataset, sampling, seed

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]) -> dict[str, Any]:
        row, epoch = key
        if self.sampling == "first":
            return self.dataset.item(row)
        count = self.dataset.positive_counts[row]
        return self.dataset.item(row, positive=drawn_positive(count, self.sampling, seed=self.seed, epoch=epoch, row=row))

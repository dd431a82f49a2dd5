"""Several training datasets as one ``RetrievalDataset`` (``raggedvl train --dataset a --dataset b``).

Rows keep their order, dataset after dataset (dataset d's rows are global indices
``offset_d .. offset_d + len_d - 1``, which :class:`raggedvl.sampling.Mixture` draws with
weights). Ids get their dataset's position as a prefix (``"1:doc-7"``), so two datasets that
both number their rows ``train-0, train-1, ...`` stay distinct documents; errors and reports name
the row by its own dataset (``row_name``). Images stay undecoded and are read on access.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from typing import Any

from raggedvl.data.dataset import RetrievalDataset


class _Chain(Sequence):
    """Lazy concatenation of sequences (no item is read until it is indexed)."""

    def __init__(self, parts: Sequence[Sequence[Any]]) -> None:
        self.parts = list(parts)
        self.starts = [0]
        for part in self.parts:
            self.starts.append(self.starts[-1] + len(part))

    def __len__(self) -> int:
        return self.starts[-1]

    def __iter__(self):
        for part in self.parts:
            yield from part

    def __getitem__(self, index: int) -> Any:
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} outside [0, {len(self)})")
        part = bisect_right(self.starts, index) - 1
        return self.parts[part][index - self.starts[part]]


def concat_datasets(parts: Sequence[RetrievalDataset], names: Sequence[str]) -> RetrievalDataset:
    """The rows of ``parts`` in order, as one dataset (module docstring); one part is returned
    as is. Rows keep their own positives and hard negatives (any number each). Raises
    ``ValueError`` when some parts have a hard-negatives column and others none, or when they
    differ in their bad-image policy."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    for name, part in zip(names, parts):
        if (part.negative_sources is None) != (first.negative_sources is None):
            with_, without = (names[0], name) if part.negative_sources is None else (name, names[0])
            raise ValueError(f"{with_} has a hard-negatives column but {without} has none; load every dataset with "
                             "the same --negatives-column")
        if (part.on_bad_image, part.max_source_pixels) != (first.on_bad_image, first.max_source_pixels):
            raise ValueError(f"{name} reads images with other settings than {names[0]}; load them with the same ones")
    records = []
    for d, part in enumerate(parts):
        for record in part.records:
            records.append({**record, "id": f"{d}:{record['id']}", "dataset": part.where})
    sizes = None
    if all(part._sizes is not None for part in parts):
        sizes = [size for part in parts for size in part._sizes]
    negatives = _Chain([part.negative_sources for part in parts]) if first.negative_sources is not None else None
    known = None  # each part's known negative sizes, else its sources
    if negatives is not None and any(part.negative_inputs is not None for part in parts):
        known = _Chain([part.negative_sources if part.negative_inputs is None else part.negative_inputs for part in parts])
    several = {}  # each part's positives, where some part has several per row
    if any(part._positives is not None for part in parts):
        several = dict(positive_sources=_Chain([part.positive_sources for part in parts]),
                       positive_counts=_Chain([part.positive_counts for part in parts]),
                       positive_inputs=_Chain([part.positive_sources if part._positive_inputs is None
                                               else part._positive_inputs for part in parts]))
    out = RetrievalDataset(
        records, _Chain([part.image_sources for part in parts]), first.split, sizes=sizes,
        on_bad_image=first.on_bad_image, max_source_pixels=first.max_source_pixels,
        where=" + ".join(names), on_empty_query=first.on_empty_query,
        negative_sources=negatives, negative_inputs=known,
        negative_counts=None if negatives is None else _Chain([part.negative_counts for part in parts]), **several,
    )
    out.part_sizes = [len(part) for part in parts]
    out.skipped_rows = [{**row, "dataset": part.where} for part in parts for row in part.skipped_rows]
    return out

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
    as is. Raises ``ValueError`` when the parts differ in hard negatives per row (the losses
    score the same number for every query of a batch) or in their bad-image policy."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    for name, part in zip(names, parts):
        if part.negatives_per_row != first.negatives_per_row:
            raise ValueError(
                f"{names[0]} has {first.negatives_per_row} hard negatives per row but {name} has "
                f"{part.negatives_per_row}; the losses score the same number per query: give every dataset the same count")
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
    out = RetrievalDataset(
        records, _Chain([part.image_sources for part in parts]), first.split, sizes=sizes,
        on_bad_image=first.on_bad_image, max_source_pixels=first.max_source_pixels,
        where=" + ".join(names), on_empty_query=first.on_empty_query,
        negative_sources=negatives, negatives_per_row=first.negatives_per_row, negative_inputs=known,
    )
    out.part_sizes = [len(part) for part in parts]
    out.skipped_rows = [{**row, "dataset": part.where} for part in parts for row in part.skipped_rows]
    return out

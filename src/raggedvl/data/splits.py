"""Held-out evaluation data: a hash split of one dataset, and train/evaluation overlap by
content.

Overlap is judged by what a model sees, not by ids (an id names a row of its own dataset, not its content):
an evaluation document whose image file is byte-identical to a training image (SHA-256 of the
encoded bytes), or an evaluation query whose text equals a training query (after Unicode
case folding and whitespace normalisation).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

from raggedvl.data.dataset import RetrievalDataset


def hash_split(dataset: RetrievalDataset, fraction: float) -> tuple[RetrievalDataset, RetrievalDataset]:
    """(rest, held out): a row is held out when the hash of its image content falls below
    ``fraction``, so every copy of one image lands on the same side; a held-out page is also
    left out of the rest's hard negatives (:meth:`RetrievalDataset.without_negative_pages`),
    so training never sees it. Deterministic; the held-out share is ``fraction`` in
    expectation. Raises ``ValueError`` unless 0 < fraction < 1 or when a side would be empty."""
    if not 0 < fraction < 1:
        raise ValueError(f"eval fraction must lie strictly between 0 and 1, got {fraction}")
    held = [int(hashlib.sha256(("eval-split:" + d).encode()).hexdigest()[:15], 16) / 16**15 < fraction
            for d in dataset.image_digests()]
    rest = [i for i, h in enumerate(held) if not h]
    out = [i for i, h in enumerate(held) if h]
    if not rest or not out:
        raise ValueError(
            f"--eval-fraction {fraction} of {len(dataset)} rows (by image content) leaves {len(rest)} training and "
            f"{len(out)} evaluation rows; use a fraction that keeps both sides non-empty or more data"
        )
    digests = dataset.image_digests()
    held_pages = {digests[i] for i in out}
    return dataset.select(rest).without_negative_pages(held_pages), dataset.select(out)


def normalise_query(text: str) -> str:
    return " ".join(str(text).casefold().split())


@dataclass
class Overlap:
    """Evaluation items also seen in training: ``documents`` (evaluation documents whose image
    bytes occur in training, as a positive or a hard negative), ``queries`` (evaluation queries whose text occurs in training),
    out of ``n_documents`` / ``n_queries``; ``examples``: a few evaluation ids."""

    documents: int
    queries: int
    n_documents: int
    n_queries: int
    examples: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.documents or self.queries)

    def describe(self) -> str:
        return (f"{self.documents} of {self.n_documents} evaluation documents have the same image bytes as a training "
                f"page (a positive or hard negative), and {self.queries} of {self.n_queries} evaluation queries are "
                f"also training queries (e.g. {self.examples[:3]})")


def find_overlap(train: RetrievalDataset, documents: RetrievalDataset, queries: Sequence[str], query_ids: Sequence[str] | None = None) -> Overlap:
    """Content overlap between training pairs and an evaluation corpus + queries: an evaluation
    document with the bytes of a page the pairs train on (a positive or a hard negative,
    :meth:`RetrievalDataset.page_digests`), a query with a training query's text. Reads every
    image's bytes once (no decoding)."""
    seen_images = train.page_digests()
    seen_queries = {normalise_query(q) for q in train.queries() if q}
    doc_hits = [i for i, d in zip(documents.ids(), documents.image_digests()) if d in seen_images]
    query_ids = list(query_ids) if query_ids is not None else [str(i) for i in range(len(queries))]
    query_hits = [i for i, q in zip(query_ids, queries) if normalise_query(q) in seen_queries]
    return Overlap(len(doc_hits), len(query_hits), len(documents), len(queries), (doc_hits + query_hits)[:5])

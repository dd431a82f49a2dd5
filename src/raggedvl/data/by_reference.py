"""Training rows that reference a corpus: the BEIR / ViDoRe v2-v3 layout as a training set.

A folder holding ``corpus*`` (``corpus-id`` and ``image``), ``queries*`` (``query-id`` and
``query`` / ``text``) and ``qrels*`` (``query-id``, ``corpus-id``, ``score``) parts, each a
``.parquet`` file or a folder of them (named splits where a part is a folder: ``datasets``'
file-name rules), and optionally ``negatives*`` (``query-id``, ``corpus-ids``: a list per
query, e.g. written by ``raggedvl mine``). The training rows are the queries with at least one
qrel above 0, in the queries table's order: a row's positives are its relevant pages (best
grade first, then corpus order), its hard negatives the listed pages in their order (one that is
also a positive of the query stays listed and the loss masks it, as for parquet rows).

Pages are stored once: the corpus is one memory-mapped Arrow table
(:mod:`raggedvl.data.arrow_cache`), every row refers to its pages by corpus row, and the
corpus's image headers are scanned once and cached (:mod:`raggedvl.data.scan`) however many
rows refer to a page. Reads pyarrow only (no ``datasets``, no torch).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from raggedvl.data.scan import ParquetSplit, beir_part, file_split, folder_splits, parquet_split, pick_split, read_column

ID_COLUMNS = {"corpus": ("corpus-id", "corpus_id", "_id", "id"), "queries": ("query-id", "query_id", "_id", "id")}


def _column(available: Sequence[str], wanted: Sequence[str], where: str) -> str:
    for name in wanted:
        if name in available:
            return name
    raise ValueError(f"{where} has none of the columns {list(wanted)} (columns: {list(available)})")


def part_split(root: Path, stem: str, split: str, *, required: bool = True) -> ParquetSplit | None:
    """The ``stem*`` part of a BEIR folder as a parquet split: a file is the whole part; a folder's
    files are split by name (``split`` picks one; a folder with one split is it). Raises
    ``ValueError`` for a missing required part or split."""
    part = beir_part(root, stem)
    if part is None:
        if required:
            raise ValueError(f"{root}: no {stem}* file or folder (a BEIR layout needs corpus*, queries* and qrels*)")
        return None
    if part.is_file():
        return parquet_split(part, file_split(part))
    splits = folder_splits(part) or {}
    if len(splits) == 1:
        (name,) = splits
        return parquet_split(part, name)
    return parquet_split(part, pick_split(list(splits), split, str(part)))


class Referenced(Sequence):
    """Per row, the list of ``values[p]`` for its positions ``p`` (lazy; a value read on access)."""

    def __init__(self, values: Sequence[Any], positions: Sequence[Sequence[int]]) -> None:
        self.values, self.positions = values, positions

    def __len__(self) -> int:
        return len(self.positions)

    def __getitem__(self, index: int) -> list[Any]:
        return [self.values[p] for p in self.positions[index]]


def referenced_rows(root: str | os.PathLike, split: str) -> dict[str, Any]:
    """What a BEIR training folder holds, without reading an image: the corpus split, its
    image column, its ids; per training row the query id and text, its positives and its hard
    negatives as corpus rows; ``queries_without_positive``. Raises ``ValueError`` for a missing part
    or column, a repeated corpus id, and a qrels or negatives row naming an unknown id."""
    root = Path(root).expanduser()
    corpus = part_split(root, "corpus", split)
    queries = part_split(root, "queries", split)
    qrels = part_split(root, "qrels", split)
    negatives = part_split(root, "negatives", split, required=False)
    cid = _column(corpus.columns, ID_COLUMNS["corpus"], corpus.where)
    image = _column(corpus.columns, ("image",), corpus.where)
    corpus_ids = [str(v) for v in read_column(corpus, cid)]
    position = {c: i for i, c in enumerate(corpus_ids)}
    if len(position) != len(corpus_ids):
        raise ValueError(f"{corpus.where}: corpus ids repeat ({len(corpus_ids) - len(position)} duplicates)")
    qid = _column(queries.columns, ID_COLUMNS["queries"], queries.where)
    text = _column(queries.columns, ("query", "text"), queries.where)
    r_q = _column(qrels.columns, ("query-id", "query_id"), qrels.where)
    r_c = _column(qrels.columns, ("corpus-id", "corpus_id"), qrels.where)
    r_s = _column(qrels.columns, ("score", "relevance"), qrels.where)
    relevant: dict[str, list[tuple[float, int]]] = {}
    for q, c, score in zip(read_column(qrels, r_q), read_column(qrels, r_c), read_column(qrels, r_s)):
        if str(c) not in position:
            raise ValueError(f"{qrels.where}: qrels row ({q!r}, {c!r}) names a corpus id that is not in the corpus")
        if score is not None and score > 0:
            relevant.setdefault(str(q), []).append((-float(score), position[str(c)]))
    listed: dict[str, list[int]] = {}
    if negatives is not None:
        n_q = _column(negatives.columns, ("query-id", "query_id"), negatives.where)
        n_c = _column(negatives.columns, ("corpus-ids", "corpus_ids"), negatives.where)
        for q, ids in zip(read_column(negatives, n_q), read_column(negatives, n_c)):
            unknown = [c for c in ids or [] if str(c) not in position]
            if unknown:
                raise ValueError(f"{negatives.where}: query {q!r} lists corpus ids that are not in the corpus, "
                                 f"e.g. {unknown[:3]}")
            listed[str(q)] = [position[str(c)] for c in ids or []]
    rows = {"query_ids": [], "queries": [], "positives": [], "negatives": []}
    without = 0
    for q, t in zip(read_column(queries, qid), read_column(queries, text)):
        pos = [p for _, p in sorted(relevant.get(str(q), []))]
        if not pos:
            without += 1
            continue
        rows["query_ids"].append(str(q))
        rows["queries"].append(t)
        rows["positives"].append(pos)
        rows["negatives"].append(listed.get(str(q), []))
    return {"corpus": corpus, "image_column": image, "corpus_ids": corpus_ids, **rows,
            "queries_without_positive": without, "has_negatives": negatives is not None}

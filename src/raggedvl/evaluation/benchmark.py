"""Retrieval benchmarks: a corpus of document images, a list of queries, and qrels.

Two layouts, as the ViDoRe benchmarks publish them:

(a) **Pairs (ViDoRe v1)**: rows of (query, image). :meth:`RetrievalBenchmark.from_pairs` makes
    the corpus the set of DISTINCT images (rows with byte-identical image files are one
    document: SHA-256 of the encoded bytes), and each distinct query text one query whose
    relevant documents (grade 1) are the images of every row carrying that text. Rows with no
    query (None or empty) are corpus-only documents: they stay in the corpus as distractors.
    Without this, a page that answers two queries is two documents that compete with each other
    (a perfect scorer would lose half its Recall@1), and dropping query-less rows makes the task
    easier than the benchmark. vidore-benchmark also deduplicates query texts; where one text
    sits on rows with different images it keeps only the last row's image as relevant, here every
    one of them is relevant.
(b) **BEIR (ViDoRe v2/v3)**: ``corpus`` (corpus-id, image), ``queries`` (query-id, query) and
    ``qrels`` (query-id, corpus-id, score: graded relevance) as three configs of a hub dataset
    or three local files/folders named ``corpus*``, ``queries*``, ``qrels*``
    (:func:`load_beir`). Queries without any qrels row are left out (as BEIR's loader does) and
    counted in ``dropped``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from raggedvl.data.columns import Columns
from raggedvl.data.dataset import RetrievalDataset, load_retrieval_dataset, pick_split
from raggedvl.data.scan import beir_part
from raggedvl.data.source import DataSource


@dataclass
class RetrievalBenchmark:
    """``documents``: a :class:`RetrievalDataset` whose rows are the corpus (images, ids);
    ``query_ids`` / ``queries``: texts; ``qrels[q]``: corpus position -> grade (>= 1 relevant).
    ``dropped``: rows or queries left out, by reason (never silent)."""

    name: str
    split: str
    documents: RetrievalDataset
    query_ids: list[str]
    queries: list[str]
    qrels: list[dict[int, int]]
    dropped: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not (len(self.query_ids) == len(self.queries) == len(self.qrels)):
            raise ValueError(f"{len(self.query_ids)} query ids, {len(self.queries)} queries, {len(self.qrels)} qrels entries")
        if not self.queries:
            raise ValueError(f"benchmark {self.name!r} split {self.split!r} has no query with a relevant document")
        n_docs = len(self.documents)
        for q, rels in enumerate(self.qrels):
            bad = [d for d in rels if not 0 <= d < n_docs]
            if bad:
                raise ValueError(f"query {self.query_ids[q]!r}: qrels name corpus positions {bad} outside [0, {n_docs})")

    @property
    def doc_ids(self) -> list[str]:
        return self.documents.ids()

    def counts(self) -> dict[str, Any]:
        return {"queries": len(self.queries), "documents": len(self.documents),
                "relevant": sum(sum(1 for g in r.values() if g >= 1) for r in self.qrels), **{f"dropped_{k}": v for k, v in self.dropped.items()}}

    def sample_queries(self, limit: int | None) -> "RetrievalBenchmark":
        """The ``limit`` queries whose ids hash lowest (a stable sample), the whole corpus kept
        (dropping documents would make the task easier). The number left out is added to
        ``dropped["sampled_out_queries"]``."""
        if limit is None or limit >= len(self.queries):
            return self
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        keep = sorted(sorted(range(len(self.query_ids)), key=lambda i: (hashlib.sha256(self.query_ids[i].encode()).digest(), i))[:limit])
        dropped = {**self.dropped, "sampled_out_queries": self.dropped.get("sampled_out_queries", 0) + len(self.queries) - limit}
        return RetrievalBenchmark(self.name, self.split, self.documents, [self.query_ids[i] for i in keep],
                                  [self.queries[i] for i in keep], [self.qrels[i] for i in keep], dropped)

    @classmethod
    def from_pairs(cls, pairs: RetrievalDataset, name: str = "pairs") -> "RetrievalBenchmark":
        """ViDoRe v1 protocol over (query, image) rows (module docstring). A document's id is
        the id of the first row holding its image."""
        doc_of_row = distinct_images(pairs)
        doc_rows = sorted(set(doc_of_row))
        position = {row: i for i, row in enumerate(doc_rows)}
        query_index: dict[str, int] = {}
        query_ids, queries, qrels = [], [], []
        corpus_only = 0
        for row, query in enumerate(pairs.queries()):
            if query is None or not str(query).strip():
                corpus_only += 1
                continue
            if query not in query_index:
                query_index[query] = len(queries)
                query_ids.append(str(pairs.records[row]["id"]))
                queries.append(query)
                qrels.append({})
            qrels[query_index[query]][position[doc_of_row[row]]] = 1
        dropped = {"duplicate_images": len(pairs) - len(doc_rows), "corpus_only_rows": corpus_only,
                   "duplicate_queries": len(pairs) - corpus_only - len(queries)}
        return cls(name, pairs.split, pairs.select(doc_rows, negatives=False), query_ids, queries, qrels, dropped)


def distinct_images(rows: RetrievalDataset) -> list[int]:
    """For each row, the first row holding a byte-identical image (SHA-256 of the encoded bytes)."""
    first_row: dict[str, int] = {}
    return [first_row.setdefault(digest, row) for row, digest in enumerate(rows.image_digests())]


def load_corpus(name_or_path: str | os.PathLike, split: str = "test", *, on_bad_image: str = "error",
                columns: Columns = Columns(), **load_kwargs) -> RetrievalDataset:
    """The documents of a benchmark or dataset, each distinct image once (for indexing): the
    ``corpus`` of a BEIR layout, else the distinct images of the rows: a folder of page images
    or (query, image) pairs alike (``columns.query`` is not read; every document's query is
    None). Local parquet is read without ``datasets``."""
    if DataSource.of(name_or_path).is_beir():
        return _corpus_documents(name_or_path, split, on_bad_image, **load_kwargs)
    rows = load_retrieval_dataset(name_or_path, split, on_bad_image=on_bad_image, on_empty_query="keep",
                                  columns=dataclasses.replace(columns, query=None), **load_kwargs)
    return rows.select(sorted(set(distinct_images(rows))))


def _column(columns: Sequence[str], wanted: Sequence[str], table: str) -> str:
    for name in wanted:
        if name in columns:
            return name
    raise ValueError(f"the {table} table has none of the columns {list(wanted)} (columns: {list(columns)})")


def _load_table(name_or_path: str | os.PathLike, part: str, split: str, **load_kwargs):
    import datasets

    root = Path(name_or_path)
    if root.is_dir():
        found = beir_part(root, part)
        if found is None:
            raise ValueError(f"{root}: no {part}* file or folder (a BEIR layout needs corpus*, queries* and qrels*)")
        files = [str(found)] if found.is_file() else sorted(str(p) for p in found.rglob("*.parquet"))
        if found.is_dir() and not files:
            raise ValueError(f"{found} holds no .parquet file")
        if found.is_dir():
            splits = datasets.load_dataset(str(found), **load_kwargs)
            return splits[pick_split(list(splits), split, str(found))]
        return datasets.load_dataset("parquet", data_files=files, split="train", **load_kwargs)
    available = datasets.get_dataset_split_names(str(name_or_path), part)
    return datasets.load_dataset(str(name_or_path), part, split=pick_split(available, split, f"{name_or_path} ({part})"), **load_kwargs)


def _corpus_documents(name_or_path, split: str, on_bad_image: str, **load_kwargs) -> RetrievalDataset:
    import datasets

    corpus = _load_table(name_or_path, "corpus", split, **load_kwargs)
    cid = _column(corpus.column_names, ("corpus-id", "corpus_id", "_id", "id"), "corpus")
    corpus = corpus.cast_column(cid, datasets.Value("string"))
    base = Path(name_or_path) if Path(name_or_path).is_dir() else None
    columns = Columns(query=None, image=_column(corpus.column_names, ("image",), "corpus"), id=cid)
    return RetrievalDataset.from_hf(corpus, split, columns=columns,
                                    base_dir=base, on_empty_query="keep", on_bad_image=on_bad_image)


def load_beir(name_or_path: str | os.PathLike, split: str = "test", *, on_bad_image: str = "error", **load_kwargs) -> RetrievalBenchmark:
    """A BEIR-layout benchmark (module docstring (b)). Column names: ``corpus-id`` / ``corpus_id``
    / ``_id`` / ``id`` with ``image``; ``query-id`` / ``query_id`` / ``_id`` / ``id`` with
    ``query`` / ``text``; qrels ``query-id``, ``corpus-id``, ``score`` (an integer grade).

    Raises ``ValueError`` for a missing part or column, a repeated id, or a qrels row naming an
    unknown corpus id."""
    documents = _corpus_documents(name_or_path, split, on_bad_image, **load_kwargs)
    queries = _load_table(name_or_path, "queries", split, **load_kwargs)
    qrels = _load_table(name_or_path, "qrels", split, **load_kwargs)
    qid = _column(queries.column_names, ("query-id", "query_id", "_id", "id"), "queries")
    qtext = _column(queries.column_names, ("query", "text"), "queries")
    r_q = _column(qrels.column_names, ("query-id", "query_id"), "qrels")
    r_c = _column(qrels.column_names, ("corpus-id", "corpus_id"), "qrels")
    r_s = _column(qrels.column_names, ("score", "relevance"), "qrels")
    position = {d: i for i, d in enumerate(documents.ids())}
    if len(position) != len(documents):
        raise ValueError(f"{name_or_path}: corpus ids repeat ({len(documents) - len(position)} duplicates)")
    judged: dict[str, dict[int, int]] = {}
    for q, c, score in zip(qrels[r_q], qrels[r_c], qrels[r_s]):
        if str(c) not in position:
            raise ValueError(f"{name_or_path}: qrels row ({q!r}, {c!r}) names a corpus id that is not in the corpus")
        if isinstance(score, bool) or int(score) != score:
            raise ValueError(f"{name_or_path}: qrels row ({q!r}, {c!r}) has a non-integer score {score!r}")
        judged.setdefault(str(q), {})[position[str(c)]] = int(score)
    query_ids, texts, rels = [], [], []
    for q, text in zip(queries[qid], queries[qtext]):
        if str(q) in judged:
            query_ids.append(str(q))
            texts.append(text)
            rels.append(judged[str(q)])
    unknown = set(judged) - set(query_ids)
    if unknown:
        raise ValueError(f"{name_or_path}: qrels name query ids that are not in the queries table, e.g. {sorted(unknown)[:3]}")
    return RetrievalBenchmark(str(name_or_path), split, documents, query_ids, texts, rels,
                              {"queries_without_qrels": len(queries) - len(query_ids)})


def load_benchmark(name_or_path: str | os.PathLike, split: str = "test", *, on_bad_image: str = "error",
                   columns: Columns = Columns(), limit: int | None = None,
                   cache_dir: str | os.PathLike | None = None, **load_kwargs) -> RetrievalBenchmark:
    """A benchmark from a BEIR-layout folder or hub dataset (configs ``corpus``/``queries``/``qrels``)
    or from (query, image) pairs (any source :func:`raggedvl.data.load_retrieval_dataset` reads,
    with ``columns``; query-less rows kept as corpus-only documents). ``limit``: pairs, a stable
    sample of that many rows; BEIR, that many queries over the whole corpus."""
    source = DataSource.of(name_or_path)
    if source.is_beir():
        return load_beir(source.path or source.name, split, on_bad_image=on_bad_image, **load_kwargs).sample_queries(limit)
    pairs = load_retrieval_dataset(name_or_path, split, on_bad_image=on_bad_image, on_empty_query="keep", limit=limit,
                                   columns=columns, cache_dir=cache_dir, **load_kwargs)
    return RetrievalBenchmark.from_pairs(pairs, name=str(name_or_path))

"""`raggedvl train --dataset FOLDER` on a BEIR layout (corpus / queries / qrels, and a negatives
table by corpus id): the rows refer to their pages in the corpus, and training on them is the
same run as on the same rows written out as parquet pairs (two positives per query, 0..2 hard
negatives per row): the same per-step losses, masked pairs and hard negatives."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raggedvl.app.config import TrainConfig
from raggedvl.app.loop import train
from raggedvl.data import Columns, load_retrieval_dataset

from .test_positives_and_ragged_negatives import NEGATIVES, ROWS, _page, _settings, _steps, pages_parquet

pytestmark = pytest.mark.slow  # tiny model, a few training steps


def beir_folder(root, *, with_noise: bool = True):
    """The pairs of ``pages_parquet`` by reference: page p is corpus id ``p{p}``; query i's
    positives are pages 2i (grade 2) and 2i + 1 (grade 1); the negatives table lists the same
    pages as the parquet's column (query 2's own page 5 too: the loss masks it)."""
    root.mkdir()
    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    pages = 2 * ROWS
    pq.write_table(pa.table({"corpus-id": [f"p{p}" for p in range(pages)],
                             "image": pa.array([_page(p) for p in range(pages)], type=image)}), root / "corpus.parquet")
    queries = [f"question {i}" for i in range(ROWS)] + (["a query without a relevant page"] if with_noise else [])
    pq.write_table(pa.table({"query-id": [f"q{i}" for i in range(len(queries))], "query": queries}),
                   root / "queries.parquet")
    qrels = [(f"q{i}", f"p{2 * i + j}", 2 - j) for i in range(ROWS) for j in (1, 0)]  # grade order, not file order
    if with_noise:
        qrels.append((f"q{ROWS}", "p0", 0))
    pq.write_table(pa.table({"query-id": [q for q, _, _ in qrels], "corpus-id": [c for _, c, _ in qrels],
                             "score": [s for _, _, s in qrels]}), root / "qrels.parquet")
    listed = [[f"p{p}" for p in row] for row in NEGATIVES]
    pq.write_table(pa.table({"query-id": [f"q{i}" for i in range(ROWS)], "corpus-ids": listed}),
                   root / "negatives.parquet")
    return root


def test_a_beir_folder_loads_as_rows_referring_to_its_corpus(tmp_path):
    data = load_retrieval_dataset(beir_folder(tmp_path / "beir"), "train", cache_dir=tmp_path / "cache")
    pairs = load_retrieval_dataset(pages_parquet(tmp_path / "pairs.parquet"), "train", cache_dir=tmp_path / "cache",
                                   columns=Columns(negatives="negs"))
    assert len(data) == ROWS  # the query without a relevant page is no training row
    assert list(data.negative_counts) == [len(row) for row in NEGATIVES]
    for i in range(ROWS):
        ours, theirs = data[i], pairs[i]
        assert ours["query"] == theirs["query"]
        assert ours["doc_key"] == theirs["doc_key"] and ours["negative_keys"] == theirs["negative_keys"]
        assert ours["relevant_keys"] == theirs["relevant_keys"]
        assert ours["image"].tobytes() == theirs["image"].tobytes()
    assert data.image_sizes() == pairs.image_sizes()


def test_training_by_reference_is_the_same_run_as_on_the_same_pairs(tmp_path, small_data_cache):
    folder = beir_folder(tmp_path / "beir")
    pairs = pages_parquet(tmp_path / "pairs.parquet")
    train(TrainConfig(**_settings(pairs, small_data_cache, tmp_path / "pairs-run", max_steps=3)))
    settings = _settings(str(folder), small_data_cache, tmp_path / "beir-run", max_steps=3)
    settings.pop("negatives_column")  # the folder's negatives table
    train(TrainConfig(**settings))
    ours, theirs = _steps(tmp_path / "beir-run"), _steps(tmp_path / "pairs-run")
    assert [r["loss"] for r in ours] == [r["loss"] for r in theirs]  # the same samples, pages and negatives
    assert [(r["false_negatives"], r["hard_negatives"]) for r in ours] == \
        [(r["false_negatives"], r["hard_negatives"]) for r in theirs]

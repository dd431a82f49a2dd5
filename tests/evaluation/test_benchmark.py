"""Benchmark layouts: ViDoRe v1 pairs (deduplicated corpus, query-less rows kept) and BEIR."""

import io

import datasets
import pytest
import torch
from PIL import Image

from raggedvl.evaluation import METRICS, score_metrics
from raggedvl.evaluation.benchmark import RetrievalBenchmark, load_benchmark


def png(value, size=(40, 30)) -> bytes:
    buffer = io.BytesIO()
    Image.new("L", size, value).save(buffer, format="PNG")
    return buffer.getvalue()


def write_pairs(path, rows):
    features = datasets.Features({"query": datasets.Value("string"), "image": datasets.Image()})
    data = {"query": [q for q, _ in rows], "image": [{"bytes": b, "path": None} for _, b in rows]}
    datasets.Dataset.from_dict(data, features=features).to_parquet(str(path))
    return path


def write_beir(root, corpus, queries, qrels):
    root.mkdir(parents=True, exist_ok=True)
    datasets.Dataset.from_dict(
        {"corpus-id": [c for c, _ in corpus], "image": [{"bytes": b, "path": None} for _, b in corpus]},
        features=datasets.Features({"corpus-id": datasets.Value("string"), "image": datasets.Image()}),
    ).to_parquet(str(root / "corpus.parquet"))
    datasets.Dataset.from_dict({"query-id": [q for q, _ in queries], "query": [t for _, t in queries]}).to_parquet(str(root / "queries.parquet"))
    datasets.Dataset.from_dict({"query-id": [r[0] for r in qrels], "corpus-id": [r[1] for r in qrels], "score": [r[2] for r in qrels]}).to_parquet(
        str(root / "qrels.parquet"))
    return root


def perfect_scores(bench: RetrievalBenchmark) -> torch.Tensor:
    """Each query scores its documents by grade, every other document 0."""
    scores = torch.zeros(len(bench.queries), len(bench.documents))
    for q, rels in enumerate(bench.qrels):
        for d, g in rels.items():
            scores[q, d] = float(g)
    return scores


def test_pairs_dedupe_pages_keep_query_less_rows_and_score_a_perfect_ranker_one(tmp_path):
    # page A answers two queries; "q3" appears on two rows with different pages; None rows are distractors
    rows = [("q1", png(10)), ("q2", png(10)), ("q3", png(20)), ("q3", png(30)), (None, png(40)), (None, png(50)), ("q4", png(60))]
    bench = load_benchmark(write_pairs(tmp_path / "test.parquet", rows), split="test")
    assert len(bench.documents) == 6  # A, B, C, D, E, F: the repeated page is one document
    assert bench.queries == ["q1", "q2", "q3", "q4"]
    assert bench.qrels == [{0: 1}, {0: 1}, {1: 1, 2: 1}, {5: 1}]
    assert bench.dropped == {"duplicate_images": 1, "corpus_only_rows": 2, "duplicate_queries": 1}
    metrics = score_metrics(perfect_scores(bench), bench.qrels, bench.doc_ids)
    # q3 has two relevant pages: Recall@1 can reach only 1/2 for it (trec_eval's recall)
    assert metrics == {**dict.fromkeys(METRICS, 1.0), "recall@1": (1 + 1 + 0.5 + 1) / 4}
    only_single = load_benchmark(write_pairs(tmp_path / "single.parquet", rows[:3] + rows[4:]), split="train")
    assert score_metrics(perfect_scores(only_single), only_single.qrels, only_single.doc_ids) == dict.fromkeys(METRICS, 1.0)
    # the query-less pages stay in the corpus: a ranker that puts them first loses
    distractor_first = perfect_scores(bench)
    distractor_first[:, 3:5] = 10.0
    assert score_metrics(distractor_first, bench.qrels, bench.doc_ids)["recall@1"] == 0.0


def test_beir_layout_graded_qrels(tmp_path):
    root = write_beir(tmp_path / "bench", [("c1", png(1)), ("c2", png(2)), ("c3", png(3))],
                      [("x", "first query"), ("y", "second query"), ("z", "query without judgments")],
                      [("x", "c2", 2), ("x", "c3", 1), ("y", "c1", 1)])
    bench = load_benchmark(root)
    assert bench.doc_ids == ["c1", "c2", "c3"] and bench.query_ids == ["x", "y"]
    assert bench.qrels == [{1: 2, 2: 1}, {0: 1}] and bench.dropped == {"queries_without_qrels": 1}
    assert score_metrics(perfect_scores(bench), bench.qrels, bench.doc_ids) == {**dict.fromkeys(METRICS, 1.0), "recall@1": (0.5 + 1) / 2}
    swapped = perfect_scores(bench)
    swapped[0, 1], swapped[0, 2] = 1.0, 2.0  # grade 1 above grade 2
    assert score_metrics(swapped, bench.qrels, bench.doc_ids)["ndcg@1"] == pytest.approx(0.5 * 1.0 + 0.5 * 0.5)


def test_beir_errors_name_the_row(tmp_path):
    root = write_beir(tmp_path / "bad", [("c1", png(1))], [("x", "q")], [("x", "c9", 1)])
    with pytest.raises(ValueError, match="'c9'.*not in the corpus"):
        load_benchmark(root)

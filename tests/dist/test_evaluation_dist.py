"""Evaluation sharded over 2 gloo ranks (queries and documents split, top-k lists merged) gives
the single-process metrics, on every rank."""

import pytest

from tests.dist.harness import run_distributed

pytestmark = pytest.mark.dist


def _evaluate(rank, world_size, model_dir, bench_dir):
    from raggedvl.data import RetrievalCollator, build_processor
    from raggedvl.evaluation.benchmark import load_benchmark
    from raggedvl.evaluation.evaluator import evaluate_benchmark
    from raggedvl.models import build_retriever

    processor = build_processor("tiny")
    model = build_retriever(str(model_dir), processor=processor)
    return evaluate_benchmark(model, RetrievalCollator(processor), load_benchmark(bench_dir), batch_size=2, chunk_size=2)


def test_sharded_evaluation_equals_single_process(tmp_path):
    from tests.evaluation.test_benchmark import write_beir
    from tests.evaluation.test_eval_cli import noise_png

    from raggedvl.data import build_processor
    from raggedvl.models import build_retriever

    build_retriever("tiny", processor=build_processor("tiny"), seed=3).save_pretrained(tmp_path / "model")
    corpus = [(f"c{i}", noise_png(10 + i, (56 + 28 * (i % 3), 56))) for i in range(7)]
    queries = [(f"q{i}", f"query number {i}") for i in range(5)]
    qrels = [("q0", "c1", 1), ("q1", "c4", 2), ("q1", "c6", 1), ("q2", "c0", 1), ("q3", "c2", 1), ("q4", "c5", 1)]
    bench = write_beir(tmp_path / "bench", corpus, queries, qrels)
    single = _evaluate(0, 1, tmp_path / "model", bench)
    ranks = run_distributed(_evaluate, 2, tmp_path / "model", bench, timeout=300)
    for got in ranks:
        assert got.keys() == single.keys()
        for key, value in single.items():
            assert got[key] == pytest.approx(value, abs=1e-6), key

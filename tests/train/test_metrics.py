import math

import pytest
import torch

from raggedvl.train.metrics import mean_pairwise_cosine, random_ranker_metrics, ranks_of_relevant, retrieval_metrics


def _naive(scores, relevant):
    out = {"ndcg@5": 0.0, "recall@1": 0.0, "recall@5": 0.0, "mrr@10": 0.0}
    for i, row in enumerate(scores.tolist()):
        rank = 1 + sum(1 for j, s in enumerate(row) if j != relevant[i] and s >= row[relevant[i]])
        out["ndcg@5"] += 1 / math.log2(rank + 1) if rank <= 5 else 0
        out["recall@1"] += rank <= 1
        out["recall@5"] += rank <= 5
        out["mrr@10"] += 1 / rank if rank <= 10 else 0
    return {k: v / len(relevant) for k, v in out.items()}


def test_metrics_match_naive_reference():
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(40, 30, generator=g, dtype=torch.float64)
    relevant = torch.randint(0, 30, (40,), generator=g)
    got, want = retrieval_metrics(scores, relevant), _naive(scores, relevant)
    for k in want:
        assert got[k] == pytest.approx(want[k], abs=1e-12)


def test_ties_are_pessimistic_so_collapse_scores_worst():
    scores = torch.zeros(4, 10)
    assert ranks_of_relevant(scores, torch.arange(4)).tolist() == [10, 10, 10, 10]
    assert retrieval_metrics(scores, torch.arange(4))["recall@5"] == 0.0


def test_random_ranker_is_expectation_over_uniform_rank():
    n = 17
    ranks = torch.arange(1, n + 1, dtype=torch.float64)
    want = {
        "ndcg@5": float(torch.where(ranks <= 5, 1 / torch.log2(ranks + 1), 0).mean()),
        "recall@1": 1 / n,
        "recall@5": 5 / n,
        "mrr@10": float(torch.where(ranks <= 10, 1 / ranks, 0).mean()),
    }
    got = random_ranker_metrics(n)
    for k in want:
        assert got[k] == pytest.approx(want[k])


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="relevant indices"):
        retrieval_metrics(torch.zeros(2, 3), torch.tensor([0, 3]))


def test_mean_pairwise_cosine_detects_collapse():
    same = torch.ones(5, 4) + 1e-6 * torch.randn(5, 4)
    assert mean_pairwise_cosine(same) > 0.999
    assert abs(mean_pairwise_cosine(torch.eye(4))) < 1e-12

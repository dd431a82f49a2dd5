import math

import pytest
import torch

from raggedvl.evaluation import METRICS, mean_pairwise_cosine, score_metrics


def _naive(scores, relevant, ids):
    """One relevant document per query; rank = 1 + documents ahead of it (higher score, or equal
    score and a larger id: trec_eval's order)."""
    out = dict.fromkeys(METRICS, 0.0)
    for i, row in enumerate(scores.tolist()):
        r = relevant[i]
        rank = 1 + sum(1 for j, s in enumerate(row) if j != r and (s > row[r] or s == row[r] and ids[j] > ids[r]))
        for k in (1, 3, 5, 10):
            out[f"ndcg@{k}"] += 1 / math.log2(rank + 1) if rank <= k else 0
        for k in (1, 5, 10):
            out[f"recall@{k}"] += rank <= k
        out["mrr@10"] += 1 / rank if rank <= 10 else 0
        out["map@10"] += 1 / rank if rank <= 10 else 0
    return {k: v / len(relevant) for k, v in out.items()}


def test_metrics_match_naive_reference_with_ties():
    g = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 4, (40, 30), generator=g).double()  # many ties
    relevant = torch.randint(0, 30, (40,), generator=g).tolist()
    ids = [f"doc-{i:02d}" for i in range(30)]
    got = score_metrics(scores, [{r: 1} for r in relevant], ids)
    want = _naive(scores, relevant, ids)
    for k in METRICS:
        assert got[k] == pytest.approx(want[k], abs=1e-12)


def test_collapsed_scores_are_neither_flattered_nor_punished():
    """All scores equal: the rank is set by the ids alone (trec_eval), so on average a collapsed
    model scores like a random ranker, not worst (pessimistic ties) or best (optimistic)."""
    n = 10
    got = score_metrics(torch.zeros(n, n), [{i: 1} for i in range(n)], [str(i) for i in range(n)])
    assert got["recall@1"] == pytest.approx(1 / n)  # exactly one query's document ranks first
    assert got["recall@5"] == pytest.approx(5 / n)


def test_mean_pairwise_cosine_detects_collapse():
    same = torch.ones(5, 4) + 1e-6 * torch.randn(5, 4)
    assert mean_pairwise_cosine(same) > 0.999
    assert abs(mean_pairwise_cosine(torch.eye(4))) < 1e-12


def test_random_rank_moments_and_the_chance_verdict():
    import itertools
    import statistics

    from raggedvl.evaluation.evaluator import chance_verdict, random_rank_moments

    n = 6
    for relevant in (1, 2, 3):
        firsts = [1 + min(perm.index(d) for d in range(relevant)) for perm in itertools.permutations(range(n))]
        got = random_rank_moments(n, [dict.fromkeys(range(relevant), 1)] * 4)  # 4 queries: se = sd / 2
        assert got["random_mean_rank"] == pytest.approx(statistics.fmean(firsts))
        assert got["random_mean_rank_se"] == pytest.approx(statistics.pstdev(firsts) / 2)
    at_chance = {"mean_rank": 64.3, "random_mean_rank": 64.5, "random_mean_rank_se": 3.3}
    assert "not distinguishable from chance (|z| <= 3)" in chance_verdict(at_chance)
    near = chance_verdict({**at_chance, "mean_rank": 64.5 - 2.8 * 3.3})  # z = -2.8: inside the 3-sigma band
    assert "(z = -2.8): not distinguishable from chance (|z| <= 3)" in near and "no better than random" not in near
    assert "better than chance" in chance_verdict({**at_chance, "mean_rank": 1.4})
    assert "WORSE than chance" in chance_verdict({**at_chance, "mean_rank": 90.0})

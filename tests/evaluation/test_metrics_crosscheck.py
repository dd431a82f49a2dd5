"""Every metric equals pytrec_eval's (trec_eval, as BEIR / mteb / ViDoRe use it) on random runs
with ties, several relevant documents per query and graded qrels."""

import itertools
import math
import random

import pytest
import torch

from raggedvl.evaluation import METRICS, random_ranker_metrics, ranking_metrics, score_metrics, tie_keys, top_k
from raggedvl.evaluation.metrics import query_metrics

pytrec_eval = pytest.importorskip("pytrec_eval")

TREC_NAMES = {"ndcg": "ndcg_cut_{k}", "recall": "recall_{k}", "map": "map_cut_{k}"}


def _trec(scores, qrels, doc_ids):
    """pytrec_eval's per-query values of METRICS for a full run (every document scored)."""
    run = {f"q{i}": {doc_ids[j]: float(s) for j, s in enumerate(row)} for i, row in enumerate(scores.tolist())}
    judged = {f"q{i}": {doc_ids[d]: int(g) for d, g in rels.items()} for i, rels in enumerate(qrels)}
    measures = {"ndcg_cut.1,3,5,10", "recall.1,5,10", "map_cut.10"}
    full = pytrec_eval.RelevanceEvaluator(judged, measures).evaluate(run)
    # MRR@10: recip_rank of the run cut at 10 in trec_eval's own order (score desc, id desc)
    cut = {}
    for q, docs in run.items():
        by_id = sorted(docs.items(), key=lambda kv: kv[0].encode(), reverse=True)
        cut[q] = dict(sorted(by_id, key=lambda kv: -kv[1])[:10])  # stable: ties keep id-descending order
    mrr = pytrec_eval.RelevanceEvaluator(judged, {"recip_rank"}).evaluate(cut)
    out = []
    for i in range(len(qrels)):
        row = {}
        for name in METRICS:
            base, k = name.split("@")
            row[name] = mrr[f"q{i}"]["recip_rank"] if base == "mrr" else full[f"q{i}"][TREC_NAMES[base].format(k=k)]
        out.append(row)
    return out


def _random_case(rng: random.Random, n_q: int, n_d: int, levels: int, graded: bool):
    scores = torch.tensor([[rng.randrange(levels) / levels for _ in range(n_d)] for _ in range(n_q)], dtype=torch.float64)
    ids = rng.sample([f"d{i}" for i in range(3 * n_d)] + ["a", "B", "b", "aa", "é"], n_d)
    qrels = []
    for _ in range(n_q):
        rel = rng.sample(range(n_d), rng.randint(1, min(6, n_d)))
        qrels.append({d: (rng.randint(1, 3) if graded else 1) for d in rel})
        if rng.random() < 0.3:  # judged non-relevant documents
            qrels[-1].update({d: 0 for d in rng.sample(range(n_d), 2) if d not in qrels[-1]})
    return scores, qrels, ids


@pytest.mark.parametrize("seed", range(6))
def test_every_metric_equals_pytrec_eval_on_random_runs_with_ties(seed):
    rng = random.Random(seed)
    levels = [2, 3, 5, 1000][seed % 4]  # 2 levels: most scores tie; 1000: few ties
    scores, qrels, ids = _random_case(rng, n_q=25, n_d=rng.randint(7, 40), levels=levels, graded=seed % 2 == 0)
    want = _trec(scores, qrels, ids)
    ranked = top_k(scores, 10, tie_keys(ids)).indices
    for q in range(len(qrels)):
        got = query_metrics(ranked[q].tolist(), qrels[q])
        for name in METRICS:
            assert got[name] == pytest.approx(want[q][name], abs=1e-12), (seed, q, name)
    means = score_metrics(scores, qrels, ids)
    for name in METRICS:
        assert means[name] == pytest.approx(sum(w[name] for w in want) / len(want), abs=1e-12)


def test_all_scores_tied_ranks_by_id_descending_like_trec_eval():
    ids = ["d1", "d10", "d9", "a"]
    ranked = top_k(torch.zeros(1, 4), 4, tie_keys(ids)).indices[0].tolist()
    assert [ids[i] for i in ranked] == ["d9", "d10", "d1", "a"]
    want = _trec(torch.zeros(1, 4), [{1: 1}], ids)[0]  # relevant "d10": rank 2 under trec_eval
    assert want["mrr@10"] == 0.5
    assert query_metrics(ranked, {1: 1})["mrr@10"] == 0.5


def test_query_without_relevant_document_scores_zero_like_trec_eval():
    scores = torch.tensor([[0.3, 0.2, 0.1]])
    want = _trec(scores, [{0: 0, 1: 0}], ["x", "y", "z"])[0]
    assert all(v == 0.0 for v in want.values())
    assert score_metrics(scores, [{0: 0, 1: 0}], ["x", "y", "z"]) == dict.fromkeys(METRICS, 0.0)


def test_random_ranker_equals_the_mean_over_every_permutation():
    n = 6
    for qrels in ([{0: 1}], [{0: 1, 3: 2}], [{1: 3, 2: 1, 5: 1}, {4: 1}]):
        total = dict.fromkeys(METRICS, 0.0)
        perms = list(itertools.permutations(range(n)))
        for perm in perms:
            for name, value in ranking_metrics([list(perm)] * len(qrels), qrels).items():
                total[name] += value
        got = random_ranker_metrics(n, qrels)
        for name in METRICS:
            assert got[name] == pytest.approx(total[name] / len(perms), abs=1e-12), (qrels, name)
    assert random_ranker_metrics(17)["mrr@10"] == pytest.approx(sum(1 / r for r in range(1, 11)) / 17)
    assert random_ranker_metrics(17)["ndcg@5"] == pytest.approx(sum(1 / math.log2(r + 1) for r in range(1, 6)) / 17)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="unknown metric"):
        ranking_metrics([[0]], [{0: 1}], ["ndcg@x"])
    with pytest.raises(ValueError, match="outside"):
        score_metrics(torch.zeros(1, 2), [{5: 1}], ["a", "b"])
    with pytest.raises(ValueError, match="more than once"):
        tie_keys(["a", "b", "a"])
    with pytest.raises(ValueError, match="NaN"):
        top_k(torch.tensor([[0.0, float("nan")]]), 1, tie_keys(["a", "b"]))

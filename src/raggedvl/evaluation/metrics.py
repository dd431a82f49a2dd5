"""Retrieval metrics as the field reports them: nDCG@k, Recall@k, MRR@k, MAP@k.

Inputs: a ranking (the best documents of each query, best first, as corpus positions; see
:mod:`raggedvl.evaluation.ranking` for trec_eval's tie order) and qrels (per query, a mapping
corpus position -> graded relevance, an int). Definitions are trec_eval's, as pytrec_eval
computes them for BEIR, mteb and the ViDoRe benchmarks (cross-checked in
tests/evaluation/test_metrics_crosscheck.py):

- a document is relevant when its grade is >= 1; R = the query's number of relevant documents;
- nDCG@k = DCG@k / IDCG@k with DCG@k = sum_{r<=k} gain_r / log2(r + 1), gain = the grade
  (linear gains; grades <= 0 gain 0), IDCG@k the DCG of the qrels' grades sorted descending;
  0 when the query has no relevant document;
- Recall@k = (relevant documents in the top k) / R;
- MRR@k = 1 / (rank of the first relevant document) if it is within the top k, else 0
  (trec_eval's recip_rank on the run cut at k);
- MAP@k = (sum over relevant documents at ranks r <= k of precision@r) / R (trec_eval's
  map_cut: the denominator is R, not min(R, k)).

A query with no relevant document scores 0 on every metric (as in trec_eval) and still counts
in the mean; loaders drop queries without qrels before this point and report how many.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

CUTOFFS = {"ndcg": (1, 3, 5, 10), "recall": (1, 5, 10), "mrr": (10,), "map": (10,)}
METRICS = tuple(f"{name}@{k}" for name, ks in CUTOFFS.items() for k in ks)
"""Metric names in report order: ndcg@1, ndcg@3, ndcg@5, ndcg@10, recall@1, recall@5,
recall@10, mrr@10, map@10."""
MAX_CUTOFF = max(k for ks in CUTOFFS.values() for k in ks)

Qrels = Sequence[Mapping[int, int]]


def _parse(name: str) -> tuple[str, int]:
    base, _, k = name.partition("@")
    if base not in CUTOFFS or not k.isdigit() or int(k) < 1:
        raise ValueError(f"unknown metric {name!r}; use ndcg@k, recall@k, mrr@k or map@k with k >= 1 (e.g. {METRICS})")
    return base, int(k)


def query_metrics(ranked: Sequence[int], qrels: Mapping[int, int], names: Sequence[str] = METRICS) -> dict[str, float]:
    """The metrics ``names`` of one query: ``ranked`` its documents best first (at least the
    largest cutoff of ``names``, or the whole corpus), ``qrels`` corpus position -> grade."""
    grades = [int(qrels.get(int(d), 0)) for d in ranked]
    n_rel = sum(1 for g in qrels.values() if g >= 1)
    ideal = sorted((g for g in qrels.values() if g > 0), reverse=True)
    hits = [g >= 1 for g in grades]
    out = {}
    for name in names:
        base, k = _parse(name)
        if n_rel == 0:
            out[name] = 0.0
        elif base == "ndcg":
            dcg = sum(g / math.log2(r + 2) for r, g in enumerate(grades[:k]) if g > 0)
            idcg = sum(g / math.log2(r + 2) for r, g in enumerate(ideal[:k]))
            out[name] = dcg / idcg
        elif base == "recall":
            out[name] = sum(hits[:k]) / n_rel
        elif base == "mrr":
            first = next((r for r, h in enumerate(hits[:k]) if h), None)
            out[name] = 0.0 if first is None else 1.0 / (first + 1)
        else:  # map
            found, total = 0, 0.0
            for r, h in enumerate(hits[:k]):
                if h:
                    found += 1
                    total += found / (r + 1)
            out[name] = total / n_rel
    return out


def check_qrels(qrels: Qrels, n_queries: int, n_docs: int) -> None:
    """Raise ``ValueError`` unless ``qrels`` has one mapping per query with corpus positions in
    ``[0, n_docs)`` and integer grades."""
    if len(qrels) != n_queries:
        raise ValueError(f"qrels has {len(qrels)} entries for {n_queries} queries")
    for q, rels in enumerate(qrels):
        for d, g in rels.items():
            if not 0 <= int(d) < n_docs:
                raise ValueError(f"qrels of query {q} name corpus position {d}, outside [0, {n_docs})")
            if isinstance(g, bool) or int(g) != g:
                raise ValueError(f"qrels of query {q}: grade {g!r} of document {d} is not an integer")


def ranking_metrics(ranked: torch.Tensor | Sequence[Sequence[int]], qrels: Qrels, names: Sequence[str] = METRICS) -> dict[str, float]:
    """Mean of :func:`query_metrics` over queries. ``ranked`` ``[Q, K]`` (K >= the largest
    cutoff, or the corpus size), e.g. ``top_k(...).indices``. Raises ``ValueError`` when the
    numbers of queries differ or ``names`` holds an unknown metric."""
    rows = ranked.tolist() if isinstance(ranked, torch.Tensor) else [list(r) for r in ranked]
    if len(rows) != len(qrels):
        raise ValueError(f"{len(rows)} ranked queries but {len(qrels)} qrels entries")
    for name in names:
        _parse(name)
    if not rows:
        return {name: float("nan") for name in names}
    totals = dict.fromkeys(names, 0.0)
    for row, rels in zip(rows, qrels):
        for name, value in query_metrics(row, rels, names).items():
            totals[name] += value
    return {name: total / len(rows) for name, total in totals.items()}


def score_metrics(scores_QC: torch.Tensor, qrels: Qrels, doc_ids: Sequence[str], names: Sequence[str] = METRICS) -> dict[str, float]:
    """Metrics of a dense score matrix ``[Q, C]`` (ranked in trec_eval's order; ``doc_ids`` [C]
    break ties)."""
    from raggedvl.evaluation.ranking import tie_keys, top_k

    check_qrels(qrels, scores_QC.shape[0], scores_QC.shape[1])
    k = max(_parse(n)[1] for n in names)
    return ranking_metrics(top_k(scores_QC, k, tie_keys(doc_ids)).indices, qrels, names)


def _expected_first_hit(n: int, n_rel: int, k: int) -> float:
    """E[1/rank of the first relevant document, 0 beyond k] for a uniformly random order."""
    total, none_before = 0.0, 1.0  # P(no relevant document in ranks 1..r-1)
    for r in range(1, min(k, n) + 1):
        p_here = none_before * n_rel / (n - r + 1)
        total += p_here / r
        none_before *= (n - r + 1 - n_rel) / (n - r + 1)
    return total


def random_ranker_metrics(n_docs: int, qrels: Qrels | None = None, names: Sequence[str] = METRICS) -> dict[str, float]:
    """Expected metrics of a uniformly random ranking of ``n_docs`` documents, averaged over
    ``qrels`` (default: one relevant document of grade 1 per query). Exact expectations: a
    document sits at each rank with probability 1/n; the first relevant document's rank is
    hypergeometric; precision@r given a hit at r is 1 + (r-1)(R-1)/(n-1) over r."""
    if n_docs < 1:
        raise ValueError(f"n_docs must be >= 1, got {n_docs}")
    n = n_docs
    qrels = qrels if qrels is not None else [{0: 1}]
    totals = dict.fromkeys(names, 0.0)
    for rels in qrels:
        grades = sorted((g for g in rels.values() if g > 0), reverse=True)
        n_rel = sum(1 for g in rels.values() if g >= 1)
        for name in names:
            base, k = _parse(name)
            kk = min(k, n)
            if n_rel == 0:
                continue
            if base == "ndcg":
                discount = sum(1.0 / math.log2(r + 1) for r in range(1, kk + 1)) / n
                idcg = sum(g / math.log2(r + 2) for r, g in enumerate(grades[:k]))
                totals[name] += sum(grades) * discount / idcg
            elif base == "recall":
                totals[name] += kk / n
            elif base == "mrr":
                totals[name] += _expected_first_hit(n, n_rel, k)
            else:
                precision = sum((1 + (r - 1) * (n_rel - 1) / max(1, n - 1)) / r for r in range(1, kk + 1))
                totals[name] += precision / n  # (1/R) * sum_r P(relevant at r) * E[prec | hit], P = R/n
    return {name: total / len(qrels) for name, total in totals.items()}


def mean_pairwise_cosine(vectors: torch.Tensor, *, as_tensor: bool = False) -> float | torch.Tensor:
    """Mean cosine similarity over distinct pairs of rows of ``vectors`` [n, D] (n >= 2; NaN
    below). A value near 1 means the embeddings have collapsed onto one direction.
    ``as_tensor``: a 0-dim float64 tensor on ``vectors``' device instead of a float (no host sync)."""
    if vectors.shape[0] < 2:
        nan = float("nan")
        return torch.tensor(nan, dtype=torch.float64, device=vectors.device) if as_tensor else nan
    v = torch.nn.functional.normalize(vectors.to(torch.float64), dim=-1, eps=1e-12)
    sim = v @ v.T
    n = v.shape[0]
    mean = (sim.sum() - sim.diagonal().sum()) / (n * (n - 1))
    return mean if as_tensor else float(mean)

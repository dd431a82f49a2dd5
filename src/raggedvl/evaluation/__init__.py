"""Retrieval evaluation as the field reports it (library code, no training dependency):
trec_eval-order rankings, metrics, benchmark layouts, chunked search and embedding indexes."""

from raggedvl.evaluation.metrics import (
    METRICS,
    mean_pairwise_cosine,
    query_metrics,
    random_ranker_metrics,
    ranking_metrics,
    score_metrics,
)
from raggedvl.evaluation.ranking import TopK, merge_top_k, tie_keys, top_k

__all__ = [
    "METRICS",
    "TopK",
    "mean_pairwise_cosine",
    "merge_top_k",
    "query_metrics",
    "random_ranker_metrics",
    "ranking_metrics",
    "score_metrics",
    "tie_keys",
    "top_k",
]

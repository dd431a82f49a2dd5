"""Retrieval metrics for one relevant document per query: nDCG@k, Recall@k, MRR@k.

Shapes: ``scores`` [n_queries, n_docs]; ``relevant`` [n_queries] (index of each query's
relevant document). Ties are ranked pessimistically: a document scoring exactly as high as the
relevant one is counted ahead of it, so a collapsed model (all scores equal) gets the worst
rank, never a flattering one. Definitions follow the ViDoRe benchmark (Faysse et al., 2024,
"ColPali"), with binary relevance: nDCG@k = 1/log2(1 + rank) if rank <= k else 0.
"""

from __future__ import annotations

import math

import torch

METRICS = ("ndcg@5", "recall@1", "recall@5", "mrr@10")


def ranks_of_relevant(scores: torch.Tensor, relevant: torch.Tensor) -> torch.Tensor:
    """1-based rank [n_queries] of each query's relevant document (pessimistic ties).

    Raises ``ValueError`` on shape mismatch or an out-of-range index."""
    if scores.ndim != 2 or relevant.shape != (scores.shape[0],):
        raise ValueError(f"scores must be [n_queries, n_docs] and relevant [n_queries]; got {tuple(scores.shape)}, {tuple(relevant.shape)}")
    if relevant.numel() and (int(relevant.min()) < 0 or int(relevant.max()) >= scores.shape[1]):
        raise ValueError(f"relevant indices must lie in [0, {scores.shape[1]}), got range [{int(relevant.min())}, {int(relevant.max())}]")
    pos = scores.gather(1, relevant[:, None].long())
    return (scores >= pos).sum(dim=1)


def retrieval_metrics(scores: torch.Tensor, relevant: torch.Tensor) -> dict[str, float]:
    """Mean nDCG@5, Recall@1, Recall@5 and MRR@10 over queries."""
    r = ranks_of_relevant(scores, relevant).to(torch.float64)
    return {
        "ndcg@5": float(torch.where(r <= 5, 1.0 / torch.log2(r + 1.0), torch.zeros_like(r)).mean()),
        "recall@1": float((r <= 1).to(torch.float64).mean()),
        "recall@5": float((r <= 5).to(torch.float64).mean()),
        "mrr@10": float(torch.where(r <= 10, 1.0 / r, torch.zeros_like(r)).mean()),
    }


def random_ranker_metrics(n_docs: int) -> dict[str, float]:
    """Expected metrics of a uniformly random ranking of ``n_docs`` documents (one relevant):
    the relevant document's rank is uniform on 1..n_docs."""
    if n_docs < 1:
        raise ValueError(f"n_docs must be >= 1, got {n_docs}")
    n = n_docs
    return {
        "ndcg@5": sum(1.0 / math.log2(r + 1) for r in range(1, min(5, n) + 1)) / n,
        "recall@1": 1.0 / n,
        "recall@5": min(5, n) / n,
        "mrr@10": sum(1.0 / r for r in range(1, min(10, n) + 1)) / n,
    }


def mean_pairwise_cosine(vectors: torch.Tensor) -> float:
    """Mean cosine similarity over distinct pairs of rows of ``vectors`` [n, D] (n >= 2).

    A value near 1 means the embeddings have collapsed onto one direction."""
    if vectors.shape[0] < 2:
        return float("nan")
    v = torch.nn.functional.normalize(vectors.to(torch.float64), dim=-1, eps=1e-12)
    sim = v @ v.T
    n = v.shape[0]
    return float((sim.sum() - sim.diagonal().sum()) / (n * (n - 1)))

"""Retrieval evaluation of a (query, document) pair set: each query's own document is its one
relevant document among all documents of the set.

Encoding is sharded over ranks (contiguous shards; every rank runs the same number of forward
calls, padding short shards with a repeat of item 0 whose outputs are dropped, so FSDP2's
per-forward collectives line up); embeddings are exchanged with ``all_gather_object`` (no
gradient), and every rank scores the full set (late interaction MaxSim in chunks, or dot
products for the bi-encoder).
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Sequence

import torch

from raggedvl.losses import late_interaction_scores
from raggedvl.parallel.runtime import get_rank, get_world_size
from raggedvl.parallel.wrap import all_gather_objects
from raggedvl.evaluation.metrics import mean_pairwise_cosine, score_metrics


def _valid_rows(emb: torch.Tensor, mask: torch.Tensor | None) -> list[torch.Tensor]:
    if mask is None:  # bi-encoder: one vector per item
        return [e.float().cpu() for e in emb]
    return [e[m].float().cpu() for e, m in zip(emb, mask.bool())]


def _pad(rows: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """list of [L_i, D] -> ([n, L_max, D] zero-padded, [n, L_max] bool mask)."""
    n, dim = len(rows), rows[0].shape[-1]
    lmax = max(1, max(r.shape[0] for r in rows))
    out = torch.zeros(n, lmax, dim)
    mask = torch.zeros(n, lmax, dtype=torch.bool)
    for i, r in enumerate(rows):
        out[i, : r.shape[0]] = r
        mask[i, : r.shape[0]] = True
    return out, mask


@torch.no_grad()
def encode_pairs(
    model: torch.nn.Module,
    dataset: Sequence[dict[str, Any]],
    collate: Callable[[list[dict[str, Any]]], dict[str, Any]],
    *,
    batch_size: int,
    device: torch.device,
    autocast: Any = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Encode every pair of ``dataset``; returns (query rows, document rows), each a list of
    ``[L_i, D]`` (multi-vector, valid tokens only) or ``[D]`` (bi-encoder) CPU float32 tensors,
    in dataset order, on every rank. Collective: one ``all_gather_object`` (and, under FSDP2, the
    model's own collectives)."""
    n, world, rank = len(dataset), get_world_size(), get_rank()
    per_rank = math.ceil(n / world)
    lo, hi = min(n, rank * per_rank), min(n, (rank + 1) * per_rank)
    n_batches = math.ceil(per_rank / batch_size)
    was_training = model.training
    model.eval()
    qs: list[torch.Tensor] = []
    ds: list[torch.Tensor] = []
    ctx = autocast or contextlib.nullcontext()
    for b in range(n_batches):
        idx = list(range(lo + b * batch_size, min(hi, lo + (b + 1) * batch_size)))
        real = len(idx)
        batch = collate([dataset[i] for i in (idx or [0])])
        with ctx:
            q, d = model(queries=batch["queries"].to(device), docs=batch["docs"].to(device))
        if real:
            qs += _valid_rows(q.embeddings, q.mask)
            ds += _valid_rows(d.embeddings, d.mask)
    model.train(was_training)
    gathered = all_gather_objects((qs, ds))
    all_q = [t for part, _ in gathered for t in part]
    all_d = [t for _, part in gathered for t in part]
    return all_q, all_d


def score_pairs(queries: list[torch.Tensor], docs: list[torch.Tensor]) -> torch.Tensor:
    """[n_q, n_d] scores: MaxSim (late interaction, chunked) for [L, D] rows, dot products for [D]."""
    if queries[0].ndim == 1:
        return torch.stack(queries) @ torch.stack(docs).T
    q, qm = _pad(queries)
    d, dm = _pad(docs)
    return late_interaction_scores(q, qm, d, dm)


def evaluate_retrieval(
    model: torch.nn.Module,
    dataset: Sequence[dict[str, Any]],
    collate: Callable[[list[dict[str, Any]]], dict[str, Any]],
    *,
    batch_size: int,
    device: torch.device,
    autocast: Any = None,
) -> dict[str, float]:
    """nDCG@5, Recall@1, Recall@5, MRR@10 of ``model`` on ``dataset`` (query i's relevant
    document is document i), plus ``n`` (documents) and ``doc_mean_cosine`` (mean pairwise
    cosine of the documents' mean-pooled embeddings: near 1 means collapse)."""
    queries, docs = encode_pairs(model, dataset, collate, batch_size=batch_size, device=device, autocast=autocast)
    scores = score_pairs(queries, docs)
    # Pairs whose image was skipped (on_bad_image="skip") drop out with their query: query i's
    # relevant document is still document i of what was encoded.
    # Ties are ranked as trec_eval ranks them (score, then id descending), not pessimistically.
    metrics = score_metrics(scores, [{i: 1} for i in range(len(queries))], [f"{i:08d}" for i in range(len(queries))])
    pooled = torch.stack([d if d.ndim == 1 else d.mean(dim=0) for d in docs])
    metrics["doc_mean_cosine"] = mean_pairwise_cosine(pooled)
    metrics["n"] = len(queries)
    return metrics

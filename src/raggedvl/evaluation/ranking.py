"""Exact top-k rankings in the order of trec_eval (the evaluator behind pytrec_eval, BEIR, mteb
and the ViDoRe leaderboard).

Shape legend: Q queries, C candidate documents, K ranks kept.

Tie order. trec_eval sorts a query's run by score, descending, and breaks equal scores by
document id, DESCENDING in byte order (``strcmp(b, a)`` in ``form_res_rels.c``): among tied
documents "d9" comes before "d10", "b" before "a". The input order of the run and the ranks
written in it are ignored. A ranking that puts the relevant document first (optimistic) or last
(pessimistic) among equal scores reports numbers no other tool reproduces; this module ranks
exactly as trec_eval does, so that the metrics of :mod:`raggedvl.evaluation.metrics` equal
pytrec_eval's on the same scores (tested).

Every function here is pure (no communication) and works on any device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


def tie_keys(doc_ids: Sequence[str]) -> torch.Tensor:
    """``[C]`` int64 key per document: its position in trec_eval's order among equal scores
    (document id descending, byte order). Key 0 ranks first among ties.

    Raises ``ValueError`` for a repeated id (a run cannot hold one document twice)."""
    ids = [str(d) for d in doc_ids]
    if len(set(ids)) != len(ids):
        seen: set[str] = set()
        dup = next(d for d in ids if d in seen or seen.add(d))
        raise ValueError(f"document ids must be unique; {dup!r} occurs more than once")
    order = sorted(range(len(ids)), key=lambda i: ids[i].encode("utf-8"), reverse=True)
    keys = torch.empty(len(ids), dtype=torch.long)
    keys[torch.tensor(order, dtype=torch.long)] = torch.arange(len(ids))
    return keys


@dataclass
class TopK:
    """The best ``K`` documents of each query, best first: ``scores`` ``[Q, K]`` and ``indices``
    ``[Q, K]`` (int64 corpus positions). ``K`` is ``min(k, C)``."""

    scores: torch.Tensor
    indices: torch.Tensor


def _order(scores_QM: torch.Tensor, keys_QM: torch.Tensor, k: int) -> torch.Tensor:
    """Positions [Q, min(k, M)] of the best candidates: score descending, then key ascending."""
    by_key = keys_QM.argsort(dim=1, stable=True)
    by_score = scores_QM.gather(1, by_key).argsort(dim=1, descending=True, stable=True)
    return by_key.gather(1, by_score[:, :k])


def top_k(scores_QC: torch.Tensor, k: int, keys_C: torch.Tensor, offset: int | torch.Tensor = 0) -> TopK:
    """Exact top-``k`` of each row of ``scores_QC`` in trec_eval order (``keys_C`` from
    :func:`tie_keys`, one per column); indices are column positions plus ``offset`` (for a corpus
    scored in chunks), or ``offset[column]`` when ``offset`` is a ``[C]`` tensor of corpus
    positions. Cost: one ``topk`` to find each row's k-th score, then a sort of only the scores
    at or above it (all of them when every score ties, as for a collapsed model).

    Raises ``ValueError`` for ``k < 1`` or mismatched shapes."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if scores_QC.ndim != 2 or keys_C.shape != (scores_QC.shape[1],):
        raise ValueError(f"scores must be [Q, C] and keys [C]; got {tuple(scores_QC.shape)} and {tuple(keys_C.shape)}")
    if scores_QC.is_floating_point() and bool(torch.isnan(scores_QC).any()):
        rows = torch.isnan(scores_QC).any(dim=1).nonzero().flatten().tolist()
        raise ValueError(f"scores of queries {rows[:8]} contain NaN; a ranking needs comparable scores")
    n_q, n_c = scores_QC.shape
    kk = min(k, n_c)
    if n_c == 0 or n_q == 0:
        empty = torch.empty(n_q, 0, dtype=torch.long, device=scores_QC.device)
        return TopK(scores_QC.new_empty(n_q, 0), empty)
    kth = scores_QC.topk(kk, dim=1).values[:, -1:]
    m = int((scores_QC >= kth).sum(dim=1).max())  # every score >= a row's k-th is among its m best
    cand_scores, cand_cols = scores_QC.topk(m, dim=1)
    keys = keys_C.to(scores_QC.device)[cand_cols]
    pick = _order(cand_scores, keys, kk)
    cols = cand_cols.gather(1, pick)
    if isinstance(offset, torch.Tensor):
        return TopK(cand_scores.gather(1, pick), offset.to(cols.device)[cols])
    return TopK(cand_scores.gather(1, pick), cols + offset)


def merge_top_k(parts: Sequence[TopK], k: int, keys_C: torch.Tensor) -> TopK:
    """Merge the top-k lists of disjoint parts of one corpus (chunks, or the shards of several
    ranks) into the exact top-``k`` of the whole; ``keys_C`` are the tie keys of the whole
    corpus, indexed by the parts' corpus positions."""
    if not parts:
        raise ValueError("merge_top_k needs at least one part")
    scores = torch.cat([p.scores for p in parts], dim=1)
    indices = torch.cat([p.indices for p in parts], dim=1)
    if scores.shape[1] == 0:
        return TopK(scores, indices)
    pick = _order(scores, keys_C.to(indices.device)[indices], min(k, scores.shape[1]))
    return TopK(scores.gather(1, pick), indices.gather(1, pick))

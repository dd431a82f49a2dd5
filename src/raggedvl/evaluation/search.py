"""Exact top-k search over a multi-vector (late interaction) or single-vector corpus, scored
in chunks of documents so that memory stays bounded whatever the corpus size.

Shape legend: Q queries with Lq vectors, c documents in a chunk with Ld vectors (padded to the
chunk's longest), D embedding dim, K ranks kept.

Per chunk: MaxSim scores ``[Q, c]`` (:func:`raggedvl.losses.late_interaction_scores`, blocked,
pads masked with -inf) or dot products for single vectors, then the chunk's exact top-k in
trec_eval's order (:func:`raggedvl.evaluation.ranking.top_k`) merged into the running top-k.
The result equals the top-k of the full score matrix exactly (tested against brute force).

Memory: one chunk of documents ``c * Ld * D`` (float32), its scores ``Q * c``, MaxSim's block
(``block_elements`` floats) and the ``Q * K`` running list; never the ``Q * Lq * N * Ld`` of the
dense formula. BENCHMARKS.md "Search" has the measured figures.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import torch

from raggedvl.evaluation.ranking import TopK, merge_top_k, top_k
from raggedvl.losses import late_interaction_scores

Chunk = tuple["int | torch.Tensor", torch.Tensor, "torch.Tensor | None"]
"""(corpus position of the chunk's first document, or a ``[c]`` int64 tensor of the positions
of its documents; embeddings ``[c, Ld, D]`` or ``[c, D]``; bool mask ``[c, Ld]`` or None for
single vectors)."""


def pad_rows(rows: Sequence[torch.Tensor], dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged rows ``[L_i, D]`` -> (``[n, L_max, D]`` zero-padded, ``[n, L_max]`` bool mask)."""
    if not rows:
        raise ValueError("pad_rows needs at least one row")
    lmax, dim = max(1, max(r.shape[0] for r in rows)), rows[0].shape[-1]
    out = torch.zeros(len(rows), lmax, dim, dtype=dtype)
    mask = torch.zeros(len(rows), lmax, dtype=torch.bool)
    for i, r in enumerate(rows):
        out[i, : r.shape[0]] = r
        mask[i, : r.shape[0]] = True
    return out, mask


def chunks_of(rows: Sequence[torch.Tensor], chunk_size: int = 1024, positions: Sequence[int] | None = None) -> Iterator[Chunk]:
    """Chunks of an in-memory corpus: ragged ``[L_i, D]`` rows or single ``[D]`` vectors;
    ``positions`` (default 0..n-1) are the rows' corpus positions."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    for start in range(0, len(rows), chunk_size):
        part = list(rows[start:start + chunk_size])
        where = start if positions is None else torch.tensor(list(positions[start:start + chunk_size]), dtype=torch.long)
        if part[0].ndim == 1:
            yield where, torch.stack(part).float(), None
        else:
            emb, mask = pad_rows(part)
            yield where, emb, mask


def score_chunk(queries: torch.Tensor, query_mask: torch.Tensor | None, docs: torch.Tensor, doc_mask: torch.Tensor | None,
                *, block_elements: int = 1 << 22) -> torch.Tensor:
    """``[Q, c]`` scores: MaxSim (sum over query vectors of the best document vector) when masks
    are given, else dot products of single vectors."""
    if (query_mask is None) != (doc_mask is None):
        raise ValueError("queries and documents must both be multi-vector (with masks) or both single vectors")
    docs = docs.to(queries.dtype)
    if query_mask is None:
        return queries @ docs.T
    return late_interaction_scores(queries, query_mask, docs, doc_mask, block_elements=block_elements)


@torch.no_grad()
def search(queries: torch.Tensor, query_mask: torch.Tensor | None, chunks: Iterable[Chunk], k: int, keys_C: torch.Tensor,
           *, block_elements: int = 1 << 22) -> TopK:
    """Exact top-``k`` documents of each query over a corpus given as ``chunks`` (any order,
    disjoint, covering the corpus); ``keys_C`` are the whole corpus's tie keys
    (:func:`raggedvl.evaluation.ranking.tie_keys` of its ids). Pure (no communication)."""
    running: TopK | None = None
    for where, docs, mask in chunks:
        scores = score_chunk(queries, query_mask, docs, mask, block_elements=block_elements)
        keys = keys_C[where] if isinstance(where, torch.Tensor) else keys_C[where:where + scores.shape[1]]
        part = top_k(scores, k, keys, where)
        del scores, docs, mask  # free this chunk before the next one is read
        running = part if running is None else merge_top_k([running, part], k, keys_C)
    if running is None:
        raise ValueError("search over an empty corpus")
    return running


@torch.no_grad()
def count_ahead(queries: torch.Tensor, query_mask: torch.Tensor | None, chunks: Iterable[Chunk], scores_Q: torch.Tensor,
                keys_Q: torch.Tensor, keys_C: torch.Tensor, *, block_elements: int = 1 << 22) -> torch.Tensor:
    """``[Q]`` number of corpus documents ranked ahead of a reference document of each query
    (score above ``scores_Q[q]``, or equal with a smaller tie key than ``keys_Q[q]``), in
    trec_eval's order: 1 + count is the reference document's rank. Pure."""
    ahead = torch.zeros(queries.shape[0], dtype=torch.long)
    for where, docs, mask in chunks:
        scores = score_chunk(queries, query_mask, docs, mask, block_elements=block_elements)
        keys = keys_C[where] if isinstance(where, torch.Tensor) else keys_C[where:where + scores.shape[1]]
        ref = scores_Q.to(scores.dtype)[:, None]
        ahead += ((scores > ref) | ((scores == ref) & (keys[None, :] < keys_Q[:, None]))).sum(dim=1)
    return ahead

"""Pure contrastive-loss math: targets from gathered counts, per-query terms, global scaling.

Shape legend: rank r holds n_r queries, each with one positive document and k hard negatives
(query-major: negatives ``i*k .. i*k+k-1`` belong to query i); N = sum_r n_r, M = sum_r m_r
hard negatives over all ranks. Candidate columns, identical on every rank:
``[0, N)`` the positives of all ranks in rank order, ``[N, N+M)`` the hard negatives of all
ranks in rank order. Query i of rank r has global index offset_r + i, where offset_r is the
exclusive cumulative sum of the gathered counts, and its positive is column offset_r + i.
Hard negatives never change labels, so any k and any per-rank batch sizes keep them aligned.

Samples that only fill a batch (accelerate repeats samples from the start of the epoch to
complete the last batch; see :mod:`raggedvl.parallel.repeats`) are marked by an explicit
validity mask and dropped by :func:`real_rows` before anything is gathered: they are neither
queries nor candidates, and N counts the real samples only.

Nothing here communicates: the functions take the counts, rank and masks explicitly, so every
rank of any world size can be simulated in one process.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from raggedvl.batch.offsets import exclusive_cumsum


def ragged_rows(owners: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Row indices of the ragged items of some owners: ``[sum(counts[owners])]`` int64.

    ``counts`` [n] int64: how many consecutive items (hard negatives, relevant keys) each of the
    n owners has, owner-major; ``owners`` [p] int64: the owners to keep, in order. Returns the
    indices of their items in a ``[sum(counts)]`` tensor. Pure: no communication.
    """
    counts = counts.to(owners.device)
    sizes = counts[owners]
    first = exclusive_cumsum(counts)[owners].repeat_interleave(sizes)
    within = torch.arange(int(sizes.sum()), device=owners.device) - exclusive_cumsum(sizes).repeat_interleave(sizes)
    return first + within


def real_rows(valid: torch.Tensor, n: int, negatives_per_query: int = 0, *,
              negative_counts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Row indices of the real samples of a local batch: ``(pairs [n_real], negatives [M_real])``.

    ``valid`` [n] bool: True for a real sample, False for one that only fills the batch (a
    repeat). ``pairs`` indexes the queries and their positives; ``negatives`` indexes the hard
    negatives (query-major: ``k = negatives_per_query`` per query, or ``negative_counts[i]``
    for query i when the int64 ``[n]`` counts are given), so a dropped sample's hard negatives
    go with it. Both are int64 on ``valid``'s device. Raises ``TypeError`` for a non-bool mask
    and ``ValueError`` for a mask that is not ``[n]``.
    """
    if not isinstance(valid, torch.Tensor) or valid.dtype != torch.bool:
        raise TypeError(f"valid must be a bool tensor [n] (True = real sample), got {getattr(valid, 'dtype', type(valid))}")
    if tuple(valid.shape) != (n,):
        raise ValueError(f"valid has shape {list(valid.shape)} but the batch has {n} samples; pass one flag per sample")
    pairs = valid.nonzero().flatten()
    if negative_counts is not None:
        return pairs, ragged_rows(pairs, negative_counts)
    k = torch.arange(negatives_per_query, device=valid.device)
    return pairs, (pairs[:, None] * negatives_per_query + k[None, :]).flatten()


def positive_labels(counts: Sequence[int], rank: int, device=None) -> torch.Tensor:
    """Candidate column of each local query's positive: ``offset_rank + arange(n_rank)`` (int64).

    ``counts`` are the per-rank query counts (one positive per query). Raises ``ValueError`` for
    a rank outside ``[0, len(counts))``.
    """
    if not 0 <= rank < len(counts):
        raise ValueError(f"rank {rank} is outside [0, {len(counts)}) for counts {list(counts)}")
    start = int(exclusive_cumsum(counts)[rank])  # where rank's rows start in a rank-ordered gather
    return torch.arange(start, start + counts[rank], device=device, dtype=torch.long)


def cross_entropy_terms(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-row InfoNCE terms ``[n]``: ``-log softmax(logits [n, C])[i, labels[i]]``.

    (van den Oord et al., "Representation Learning with Contrastive Predictive Coding", 2018.)
    """
    return F.cross_entropy(logits, labels, reduction="none")


def pairwise_terms(scores: torch.Tensor, labels: torch.Tensor, *, allow_no_negative: bool = False,
                   exclude: torch.Tensor | None = None) -> torch.Tensor:
    """Per-row pairwise terms ``[n]``: ``softplus(max_{c != label} scores[i, c] - scores[i, label])``.

    The hardest negative of each query is the best-scoring candidate other than its own positive
    (ColPali's ``ColbertPairwiseCELoss``, Faysse et al. 2024) and the candidates ``exclude`` marks
    (bool ``[n, C]``, e.g. :func:`false_negative_mask`); a query whose candidates are all
    excluded gets a term of 0 with zero gradient. With fewer than 2 candidates there is no
    negative: ``ValueError`` (the candidate count is global, so every rank raises), or, with
    ``allow_no_negative`` (a batch whose repeats were dropped), terms of 0 with zero gradient.
    """
    n_cand = scores.shape[1]
    if n_cand < 2 and allow_no_negative:
        return scores.sum(dim=1) * 0.0
    if n_cand < 2:
        raise ValueError(
            f"pairwise loss needs at least 2 candidates per query, got {n_cand}; use a global "
            "batch of at least 2 pairs or pass hard negatives"
        )
    positive = scores.gather(1, labels[:, None]).squeeze(1)
    own = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, labels[:, None], True)
    if exclude is not None:
        own = own | exclude
    hardest = scores.masked_fill(own, float("-inf")).amax(dim=1)
    return F.softplus(hardest - positive)


def global_mean_share(terms: torch.Tensor, world_size: int, global_count: int) -> torch.Tensor:
    """This rank's share ``L_r = (W / N) * sum(terms)`` of the global mean (DESIGN.md section 4).

    Summed over ranks, ``sum_r L_r = W * L`` with ``L = (1/N) * sum of all N terms``; DDP's
    gradient average then divides by W, so every parameter receives exactly dL/dtheta, also when
    ranks hold different numbers of queries. Raises ``ValueError`` when ``global_count`` < 1.
    """
    if global_count < 1:
        raise ValueError(f"the global batch is empty (N={global_count}); nothing to average")
    return terms.sum() * (world_size / global_count)


def relevance(
    positive_keys: torch.Tensor,
    candidate_keys: torch.Tensor,
    *,
    relevant_keys: torch.Tensor | None = None,
    relevant_queries: torch.Tensor | None = None,
) -> torch.Tensor:
    """Which candidates each query of the global batch names relevant itself: ``[N, C]`` bool.

    Query j's own relevant documents are its positive (``positive_keys`` [N] int64) and, when
    given, its further relevant keys: ``relevant_keys`` [R] int64 with ``relevant_queries`` [R]
    int64, the global query each key belongs to (e.g. the positives of a query with several,
    besides the one drawn for this step). ``candidate_keys`` [C] int64. Pure: no communication.
    """
    if (relevant_keys is None) != (relevant_queries is None):
        raise ValueError("pass relevant_keys and relevant_queries together (or neither)")
    relevant = positive_keys[:, None] == candidate_keys[None, :]
    if relevant_keys is not None and relevant_keys.numel():
        if relevant_queries.shape != relevant_keys.shape:
            raise ValueError(
                f"relevant_queries has {relevant_queries.shape[0]} entries for {relevant_keys.shape[0]} "
                "relevant keys; pass the owning query of every key"
            )
        hits = (relevant_keys[:, None] == candidate_keys[None, :]).to(torch.float32)
        extra = torch.zeros(relevant.shape, dtype=torch.float32, device=relevant.device)
        relevant = relevant | (extra.index_add_(0, relevant_queries, hits) > 0)
    return relevant


def _same_query(query_keys: torch.Tensor, all_query_keys: torch.Tensor) -> torch.Tensor:
    return (query_keys[:, None] == all_query_keys[None, :]).to(torch.float32)


def false_negative_mask(
    labels: torch.Tensor,
    positive_keys: torch.Tensor,
    candidate_keys: torch.Tensor,
    *,
    query_keys: torch.Tensor | None = None,
    all_query_keys: torch.Tensor | None = None,
    relevant_keys: torch.Tensor | None = None,
    relevant_queries: torch.Tensor | None = None,
) -> torch.Tensor:
    """Which candidates are the same document as one of a query's relevant documents: ``[n, C]`` bool.

    ``labels`` [n] int64: each local query's own positive column. ``positive_keys`` [N] int64:
    the document key of every positive of the global batch (column j is global query j's
    positive). ``candidate_keys`` [C] int64: the key of every candidate column (the N positives,
    then the hard negatives). Two candidates with equal keys are the same document (a corpus id
    or a hash of the page content). A query's relevant documents are its own positive, its
    further relevant keys (``relevant_keys`` [R] / ``relevant_queries`` [R], see
    :func:`relevance`) and, when query keys are given, those of every query of the global batch
    with the same key (``query_keys`` [n] for the local queries, ``all_query_keys`` [N] for the
    global batch: equal keys = the same query text, e.g. several pages answer one question).

    ``mask[i, c]`` is True when candidate c is one of query i's relevant documents and not its
    own label column: such a candidate is a false negative, to be removed from the query's
    softmax denominator (in-batch false-negative filtering, as in colpali-engine's contrastive
    losses and sentence-transformers' no-duplicates sampling; positive-aware negatives,
    Moreira et al., "NV-Retriever", 2024). Pure: no communication. Raises ``ValueError`` for
    mismatched lengths.
    """
    n, total = labels.shape[0], positive_keys.shape[0]
    if (query_keys is None) != (all_query_keys is None):
        raise ValueError("pass query_keys and all_query_keys together (or neither)")
    own = relevance(positive_keys, candidate_keys, relevant_keys=relevant_keys, relevant_queries=relevant_queries)
    if query_keys is None:
        relevant = own[labels]
    else:
        if query_keys.shape[0] != n or all_query_keys.shape[0] != total:
            raise ValueError(
                f"query_keys has {query_keys.shape[0]} rows for {n} queries and all_query_keys "
                f"{all_query_keys.shape[0]} for {total} positives; pass one key per query"
            )
        # integer counts, exact in float32 below 2**24
        relevant = (_same_query(query_keys, all_query_keys) @ own.to(torch.float32)) > 0
    return relevant.scatter(1, labels[:, None], False)


def document_false_negative_mask(
    labels: torch.Tensor,
    positive_keys: torch.Tensor,
    all_query_keys: torch.Tensor | None = None,
    *,
    relevant_keys: torch.Tensor | None = None,
    relevant_queries: torch.Tensor | None = None,
) -> torch.Tensor:
    """For the document-to-query direction: which of the N queries each local positive is relevant
    to, besides its own query: ``[n, N]`` bool.

    ``labels`` [n]: the global index of each local positive (= its own query). ``positive_keys``
    [N], ``all_query_keys`` [N] (optional) and ``relevant_keys`` / ``relevant_queries`` [R]
    (optional) as in :func:`false_negative_mask`: document ``labels[i]`` is relevant to query j
    when it is one of the relevant documents of some query l with query j's key (l = j without
    query keys). Pure: no communication.
    """
    own = relevance(positive_keys, positive_keys[labels], relevant_keys=relevant_keys,
                    relevant_queries=relevant_queries).T  # [n documents, N queries]
    if all_query_keys is not None:
        own = (own.to(torch.float32) @ _same_query(all_query_keys, all_query_keys)) > 0
    return own.scatter(1, labels[:, None], False)

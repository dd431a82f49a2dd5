"""Contrastive losses as ``nn.Module`` s that exchange embeddings across ranks, then call the math.

Shape legend: rank r holds n_r query/document pairs and m_r = n_r * k hard negatives
(query-major); N = sum_r n_r; D embedding dim; Lq/Ld token vectors per query/document.

Each loss returns this rank's share ``L_r = (W / N) * sum of its n_r per-query terms``
(:func:`raggedvl.losses.functional.global_mean_share`). With DDP (gradients averaged over W)
every parameter then gets exactly the gradient of the single-process mean loss on the
concatenated global batch. ``L_r`` itself is not the global loss: for logging, all-reduce
``L_r`` and divide by W. Without a process group, at world size 1 or with
``gather_across_ranks=False`` (W = 1, N = n) the value is the plain single-process mean.

Collectives per forward (all through :mod:`raggedvl.parallel.gather`, each a header exchange
plus a data all_gather; backward adds one all_reduce per gathered tensor): the positives, the
hard negatives (always, as an empty tensor on a rank without any, so ranks never disagree on
the number of collectives) and, for symmetric InfoNCE, the queries. Ranks may pass different
numbers of hard negatives per query (or none): every query is scored against all of them, as
the single-process loss on the concatenated batch would. Every rank must call the loss and
backpropagate through it. Input errors raise before any collective.

Repeated samples: ``valid`` (bool ``[n]``, keyword-only, optional) marks the real samples of
the local batch. Samples marked False (accelerate's repeats that complete the last batch, see
:mod:`raggedvl.parallel.repeats`) are dropped with their hard negatives before the gathers
(:func:`raggedvl.losses.functional.real_rows`): they are never a query, a positive or a
negative on any rank, their embeddings get zero gradient, and N is the number of real samples
of all ranks, so the identity above holds for the real global batch. Pass ``valid`` on every
rank or on none.

False negatives: ``doc_keys`` (int64 ``[n]``, keyword-only, optional) names the document of each
positive and ``neg_keys`` (int64 ``[n*k]``) that of each hard negative; equal keys are the same
document (a corpus id, or a hash of the page content). ``query_keys`` (int64 ``[n]``, optional)
names each query's text: queries with equal keys are one query with all their positives
relevant. With keys, a candidate that is one of a query's relevant documents (another query's
positive or any hard negative, on any rank) is removed from that query's softmax denominator
(:func:`raggedvl.losses.functional.false_negative_mask`) instead of being pushed away; the
keys cost one more ``all_gather_variable`` (no gradient). After each call ``false_negatives``
holds the number of masked (local query, candidate) pairs, an int64 0-dim tensor: sum it over
ranks for the global batch; ``candidates_kept`` holds each local query's number of candidates
left in its denominator (int64 ``[n]``; None without keys), from which the loss value at equal
scores follows (the mean of ``ln candidates_kept`` for the softmax losses). Pass keys on every
rank or on none.

Several positives, variable hard negatives: ``neg_counts`` (int64 ``[n]``, optional) gives each
query's number of hard negatives (query-major, any count >= 0, summing to the rows of
``neg_emb``); without it every query has ``k = rows / n``. Ownership only decides which
negatives leave with a repeated sample: every query is scored against all hard negatives of
the global batch either way. ``relevant_keys`` (int64 ``[R]``) with ``relevant_counts`` (int64
``[n]``, summing to R) lists each query's further relevant documents (its other positives,
query-major): a candidate with one of these keys is a false negative of that query (and of
every query with the same ``query_keys``), gathered with the other keys in the same
collective. Both need ``doc_keys``; pass them on every rank or on none.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import nn

from raggedvl.losses.functional import (
    cross_entropy_terms,
    document_false_negative_mask,
    false_negative_mask,
    global_mean_share,
    pairwise_terms,
    positive_labels,
    ragged_rows,
    real_rows,
)
from raggedvl.losses.scoring import (
    DEFAULT_BLOCK_ELEMENTS,
    check_late_interaction_inputs,
    late_interaction_scores,
)
from raggedvl.parallel import all_gather_packed, all_gather_variable, get_rank, get_world_size


def _check_counts(name: str, counts, n: int, total: int, items: str) -> None:
    if not isinstance(counts, torch.Tensor) or counts.dtype != torch.int64 or tuple(counts.shape) != (n,):
        got = f"{counts.dtype} {list(counts.shape)}" if isinstance(counts, torch.Tensor) else type(counts).__name__
        raise ValueError(f"{name} must be an int64 tensor [{n}] (one count per query), got {got}")
    if n and (int(counts.min()) < 0 or int(counts.sum()) != total):
        raise ValueError(
            f"{name} {counts.tolist()} must be >= 0 and sum to the {total} {items} passed; "
            f"pass each query's number of {items}, query-major"
        )


def _negatives_per_query(n: int, neg_rows: int, neg_counts=None) -> int:
    if neg_counts is not None:
        _check_counts("neg_counts", neg_counts, n, neg_rows, "hard negatives")
        return 0
    if (n == 0 and neg_rows) or (n and neg_rows % n):
        raise ValueError(
            f"neg_emb has {neg_rows} rows for {n} queries; pass k hard negatives per query, "
            "query-major ([n * k, ...], negatives i*k..i*k+k-1 belong to query i), or each "
            "query's count as neg_counts"
        )
    return neg_rows // n if n else 0


def _check_keys(n: int, neg_rows: int, doc_keys, neg_keys, query_keys, relevant_keys=None, relevant_counts=None) -> None:
    """Local checks of the document and query keys (before any collective)."""
    if (relevant_keys is None) != (relevant_counts is None):
        raise ValueError("pass relevant_keys and relevant_counts together (or neither)")
    if doc_keys is None:
        if neg_keys is not None or query_keys is not None or relevant_keys is not None:
            raise ValueError("neg_keys, query_keys and relevant_keys need doc_keys: pass the key of every positive too")
        return
    expected = {"doc_keys": (doc_keys, n), "neg_keys": (neg_keys, neg_rows), "query_keys": (query_keys, n)}
    if relevant_keys is not None:
        expected["relevant_keys"] = (relevant_keys, relevant_keys.shape[0] if isinstance(relevant_keys, torch.Tensor) else 0)
    for name, (keys, rows) in expected.items():
        if keys is None:
            if name == "neg_keys" and neg_rows:
                raise ValueError(f"neg_keys is missing for {neg_rows} hard negatives; pass one key per hard negative")
            continue
        if not isinstance(keys, torch.Tensor) or keys.dtype != torch.int64 or tuple(keys.shape) != (rows,):
            got = f"{keys.dtype} {list(keys.shape)}" if isinstance(keys, torch.Tensor) else type(keys).__name__
            raise ValueError(f"{name} must be an int64 tensor [{rows}] (one key per row), got {got}")
    if relevant_keys is not None:
        _check_counts("relevant_counts", relevant_counts, n, relevant_keys.shape[0], "relevant keys")


class _GatheredKeys(NamedTuple):
    positives: torch.Tensor  # [N]
    candidates: torch.Tensor  # [N + M]: positives, then hard negatives, rank-ordered
    local_queries: torch.Tensor | None  # [n]
    queries: torch.Tensor | None  # [N]
    relevant: torch.Tensor | None  # [R] further relevant keys of all ranks' queries
    relevant_queries: torch.Tensor | None  # [R] the global query of each


def _owners(counts: torch.Tensor, offset: int) -> torch.Tensor:
    return offset + torch.arange(counts.shape[0], device=counts.device).repeat_interleave(counts)


def _gather_keys(doc_keys, neg_keys, query_keys, relevant_keys, relevant_counts, counts, world, group) -> _GatheredKeys:
    """All ranks' keys in candidate order; one ``all_gather_variable`` of the packed local keys."""
    neg_keys = doc_keys.new_zeros(0) if neg_keys is None else neg_keys
    has_rel = relevant_keys is not None
    parts = [doc_keys] + ([] if query_keys is None else [query_keys]) + ([relevant_counts] if has_rel else [])
    if world == 1:
        return _GatheredKeys(doc_keys, torch.cat([doc_keys, neg_keys]), query_keys, query_keys,
                             relevant_keys, _owners(relevant_counts, 0) if has_rel else None)
    packed = all_gather_variable(torch.cat(parts + ([relevant_keys] if has_rel else []) + [neg_keys]),
                                 group=group, tag="keys")
    positives, queries, negatives, relevant, owners = [], [], [], [], []
    offset = 0
    for n_r, start, size in zip(counts, packed.offsets, packed.counts):
        segment = packed.values[start:start + size]
        positives.append(segment[:n_r])
        if query_keys is not None:
            queries.append(segment[n_r:2 * n_r])
        rest = segment[len(parts) * n_r:]
        if has_rel:
            rel_counts = segment[(len(parts) - 1) * n_r:len(parts) * n_r]
            r = int(rel_counts.sum())
            relevant.append(rest[:r])
            owners.append(_owners(rel_counts, offset))
            rest = rest[r:]
        negatives.append(rest)
        offset += n_r
    positives = torch.cat(positives)
    return _GatheredKeys(
        positives, torch.cat([positives] + negatives), query_keys,
        None if query_keys is None else torch.cat(queries),
        torch.cat(relevant) if has_rel else None, torch.cat(owners) if has_rel else None,
    )


def _rows_of(keys, rows):
    return None if keys is None else keys[rows.to(keys.device)]


def _real_keys(pairs, negs, doc_keys, neg_keys, query_keys, relevant_keys, relevant_counts):
    """The keys of the real samples (``pairs``, ``negs`` from :func:`real_rows`)."""
    if relevant_keys is not None:
        relevant_keys = _rows_of(relevant_keys, ragged_rows(pairs.to(relevant_counts.device), relevant_counts))
        relevant_counts = _rows_of(relevant_counts, pairs)
    return (_rows_of(doc_keys, pairs), _rows_of(neg_keys, negs), _rows_of(query_keys, pairs),
            relevant_keys, relevant_counts)


def _mask(labels, keys: _GatheredKeys) -> torch.Tensor:
    return false_negative_mask(labels, keys.positives, keys.candidates, query_keys=keys.local_queries,
                               all_query_keys=keys.queries, relevant_keys=keys.relevant,
                               relevant_queries=keys.relevant_queries)


def _check_temperature(temperature: float) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 (logits are divided by it), got {temperature}")


class _CrossRankLoss(nn.Module):
    def __init__(self, gather_across_ranks: bool, group) -> None:
        super().__init__()
        self.gather_across_ranks = gather_across_ranks
        self.group = group
        self.false_negatives = torch.zeros((), dtype=torch.int64)
        self.candidates_kept: torch.Tensor | None = None

    def _count(self, masked: torch.Tensor | None) -> None:
        if masked is None:
            self.false_negatives, self.candidates_kept = torch.zeros((), dtype=torch.int64), None
            return
        self.false_negatives = masked.sum()
        self.candidates_kept = masked.shape[1] - masked.sum(dim=1)

    def _world(self) -> tuple[int, int]:
        if not self.gather_across_ranks:
            return 0, 1
        return get_rank(self.group), get_world_size(self.group)


class InfoNCELoss(_CrossRankLoss):
    """Bi-encoder InfoNCE over all positives and hard negatives of the global batch.

    ``forward(query_emb [n, D], doc_emb [n, D], neg_emb=None [n*k, D] query-major, *,
    valid=None [n] bool) -> L_r`` (``valid``: the module docstring's repeated samples).
    ``logits(i, c) = <q_i, cand_c> * s`` where ``s = 1 / temperature`` (a temperature divides)
    or, with ``learnable_scale=True``, ``s = exp(log_logit_scale)`` clamped to
    ``max_logit_scale`` (a logit scale multiplies; CLIP, Radford et al. 2021, initialised at
    1/temperature, log-parameterised; its gradient is 0 while clamped). The scale parameter must
    be averaged over ranks like any other: keep this module inside the DDP-wrapped model.

    Candidates of each query: the N positives of the global batch, then the M hard negatives of
    the global batch; cross-entropy against its own positive (InfoNCE, van den Oord et al. 2018).
    ``symmetric=True`` averages in the document-to-query term over the positives,
    ``0.5 * (l_q2d(i) + l_d2q(i))``, where document i is scored against the N queries of the
    global batch (hard negatives have no term of their own). Rank r computes the rows of its own
    n_r documents, so the queries are gathered too and the sum over ranks is W times the
    single-process loss. Gradient flows to every rank's embeddings through the gathers.

    Collectives per call when W > 1: ``all_gather_variable`` of the positives and of the hard
    negatives (plus the queries when symmetric), each one header and one data all_gather
    forward and one all_reduce backward. Returns ``L_r = (W/N) * sum`` of its terms.

    Raises ``ValueError`` for mismatched shapes, a non-positive temperature or an initial scale
    above ``max_logit_scale``; ``TypeError`` for mismatched dtypes.
    """

    def __init__(
        self,
        temperature: float = 0.02,
        symmetric: bool = False,
        *,
        learnable_scale: bool = False,
        max_logit_scale: float = 100.0,
        gather_across_ranks: bool = True,
        group=None,
    ) -> None:
        super().__init__(gather_across_ranks, group)
        _check_temperature(temperature)
        self.temperature = temperature
        self.symmetric = symmetric
        self.max_logit_scale = max_logit_scale
        if learnable_scale:
            if 1.0 / temperature > max_logit_scale:
                raise ValueError(
                    f"initial logit scale 1/temperature = {1.0 / temperature:g} exceeds "
                    f"max_logit_scale = {max_logit_scale:g}; raise max_logit_scale or temperature"
                )
            self.log_logit_scale = nn.Parameter(torch.tensor(math.log(1.0 / temperature)))
        else:
            self.log_logit_scale = None

    def logit_scale(self) -> torch.Tensor | float:
        """The factor that multiplies the dot products (a 0-dim tensor when learnable)."""
        if self.log_logit_scale is None:
            return 1.0 / self.temperature
        return self.log_logit_scale.clamp(max=math.log(self.max_logit_scale)).exp()

    def forward(self, query_emb, doc_emb, neg_emb=None, *, valid=None, doc_keys=None, neg_keys=None,
                query_keys=None, neg_counts=None, relevant_keys=None, relevant_counts=None):
        if query_emb.dim() != 2 or tuple(query_emb.shape) != tuple(doc_emb.shape):
            raise ValueError(
                f"InfoNCELoss needs query_emb and doc_emb of the same shape [n, D]; got "
                f"{list(query_emb.shape)} and {list(doc_emb.shape)}"
            )
        if neg_emb is None:
            neg_emb = doc_emb.new_zeros((0, doc_emb.shape[1]))
        if neg_emb.dim() != 2 or neg_emb.shape[1] != doc_emb.shape[1]:
            raise ValueError(f"neg_emb must be [n*k, D={doc_emb.shape[1]}], got {list(neg_emb.shape)}")
        if not query_emb.dtype == doc_emb.dtype == neg_emb.dtype:
            raise TypeError(
                f"dtypes differ: query {query_emb.dtype}, doc {doc_emb.dtype}, neg {neg_emb.dtype}"
            )
        k = _negatives_per_query(query_emb.shape[0], neg_emb.shape[0], neg_counts)
        _check_keys(query_emb.shape[0], neg_emb.shape[0], doc_keys, neg_keys, query_keys, relevant_keys, relevant_counts)
        if valid is not None:  # repeats leave before any gather: never a query nor a candidate
            pairs, negs = real_rows(valid.to(query_emb.device), query_emb.shape[0], k, negative_counts=neg_counts)
            query_emb, doc_emb, neg_emb = query_emb[pairs], doc_emb[pairs], neg_emb[negs]
            doc_keys, neg_keys, query_keys, relevant_keys, relevant_counts = _real_keys(
                pairs, negs, doc_keys, neg_keys, query_keys, relevant_keys, relevant_counts)
        rank, world = self._world()
        docs = all_gather_variable(doc_emb, group=self.group, tag="positives") if world > 1 else None
        all_docs = docs.values if docs else doc_emb
        counts = docs.counts if docs else [doc_emb.shape[0]]
        all_negs = (
            all_gather_variable(neg_emb, group=self.group, tag="negatives").values
            if world > 1 else neg_emb
        )
        all_queries = query_emb
        if self.symmetric and world > 1:
            all_queries = all_gather_variable(query_emb, group=self.group, tag="queries").values
        scale = self.logit_scale()
        labels = positive_labels(counts, rank, device=query_emb.device)
        logits = query_emb @ torch.cat([all_docs, all_negs]).T * scale
        d2q = doc_emb @ all_queries.T * scale if self.symmetric else None
        if doc_keys is not None:
            keys = _gather_keys(doc_keys, neg_keys, query_keys, relevant_keys, relevant_counts, counts, world,
                                self.group)
            masked = _mask(labels, keys)
            self._count(masked)
            logits = logits.masked_fill(masked, float("-inf"))
            if d2q is not None:
                d2q_masked = document_false_negative_mask(labels, keys.positives, keys.queries, relevant_keys=keys.relevant,
                                                          relevant_queries=keys.relevant_queries)
                d2q = d2q.masked_fill(d2q_masked, float("-inf"))
        else:
            self._count(None)
        terms = cross_entropy_terms(logits, labels)
        if self.symmetric:
            terms = 0.5 * (terms + cross_entropy_terms(d2q, labels))
        return global_mean_share(terms, world, sum(counts))


class _MultiVectorLoss(_CrossRankLoss):
    def __init__(self, normalize_by_query_length, gather_across_ranks, group, block_elements):
        super().__init__(gather_across_ranks, group)
        self.normalize_by_query_length = normalize_by_query_length
        self.block_elements = block_elements

    def _terms(self, scores: torch.Tensor, labels: torch.Tensor, repeats_dropped: bool,
               masked: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, query_emb, query_mask, doc_emb, doc_mask, neg_emb=None, neg_mask=None, *, valid=None,
                doc_keys=None, neg_keys=None, query_keys=None, neg_counts=None, relevant_keys=None,
                relevant_counts=None):
        n, dim = query_emb.shape[0], query_emb.shape[-1]
        if doc_emb.dim() != 3 or doc_emb.shape[0] != n:
            raise ValueError(
                f"{type(self).__name__} needs doc_emb [n={n}, Ld, D] with one positive per query; "
                f"got {list(doc_emb.shape)}"
            )
        if (neg_emb is None) != (neg_mask is None):
            raise ValueError("pass neg_emb and neg_mask together (or neither)")
        if neg_emb is None:
            neg_emb, neg_mask = doc_emb.new_zeros((0, 0, dim)), doc_mask.new_zeros((0, 0))
        k = _negatives_per_query(n, neg_emb.shape[0], neg_counts)
        # local checks of every tensor before any collective (raises ValueError/TypeError)
        check_late_interaction_inputs(query_emb, query_mask, doc_emb, doc_mask)
        check_late_interaction_inputs(query_emb, query_mask, neg_emb, neg_mask, doc_name="hard negatives")
        _check_keys(n, neg_emb.shape[0], doc_keys, neg_keys, query_keys, relevant_keys, relevant_counts)
        if valid is not None:  # repeats leave before any gather: never a query nor a candidate
            pairs, negs = real_rows(valid.to(query_emb.device), n, k, negative_counts=neg_counts)
            query_emb, query_mask, doc_emb, doc_mask = query_emb[pairs], query_mask[pairs], doc_emb[pairs], doc_mask[pairs]
            neg_emb, neg_mask = neg_emb[negs], neg_mask[negs]
            doc_keys, neg_keys, query_keys, relevant_keys, relevant_counts = _real_keys(
                pairs, negs, doc_keys, neg_keys, query_keys, relevant_keys, relevant_counts)
        rank, world = self._world()
        counts = [query_emb.shape[0]]
        if world > 1:
            docs = all_gather_packed(doc_emb, doc_mask, group=self.group, tag="positives")
            negs = all_gather_packed(neg_emb, neg_mask, group=self.group, tag="negatives")
            doc_emb, doc_mask, counts = docs.values, docs.mask, docs.counts
            neg_emb, neg_mask = negs.values, negs.mask
        scores = torch.cat(
            [
                late_interaction_scores(query_emb, query_mask, doc_emb, doc_mask,
                                        block_elements=self.block_elements),
                late_interaction_scores(query_emb, query_mask, neg_emb, neg_mask,
                                        block_elements=self.block_elements),
            ],
            dim=1,
        )
        if self.normalize_by_query_length:
            scores = scores / query_mask.sum(dim=1, keepdim=True).clamp(min=1).to(scores.dtype)
        labels = positive_labels(counts, rank, device=query_emb.device)
        masked = None
        if doc_keys is not None:
            keys = _gather_keys(doc_keys, neg_keys, query_keys, relevant_keys, relevant_counts, counts, world,
                                self.group)
            masked = _mask(labels, keys)
            self._count(masked)
        else:
            self._count(None)
        return global_mean_share(self._terms(scores, labels, valid is not None, masked), world, sum(counts))


class LateInteractionLoss(_MultiVectorLoss):
    """ColBERT-style late-interaction InfoNCE over all positives and hard negatives of the global batch.

    ``forward(query_emb [n, Lq, D], query_mask [n, Lq], doc_emb [n, Ld, D], doc_mask [n, Ld],
    neg_emb=None [n*k, Ld', D], neg_mask=None [n*k, Ld'], *, valid=None [n]) -> L_r``. Masks are
    bool, True = real token; ``valid`` (True = real sample) drops repeated samples (module
    docstring). ``score(i, j)`` is MaxSim (:func:`raggedvl.losses.late_interaction_scores`), divided
    by query i's valid-token count when ``normalize_by_query_length`` (a query without valid
    tokens scores 0 everywhere, giving the term log(number of candidates) and no gradient);
    logits = score / temperature (a temperature divides); cross-entropy against the query's own
    positive among the N positives then M hard negatives of the global batch.

    Documents and negatives are gathered with :func:`raggedvl.parallel.all_gather_packed`: only
    their real token vectors travel, and pads of the rebuilt layout are masked to -inf inside
    MaxSim. Collectives per call when W > 1: two ``all_gather_packed`` (positives, hard
    negatives), each two header and two data all_gathers forward and one all_reduce of the real
    vectors' gradient backward. Returns
    ``L_r = (W/N) * sum`` of its terms.
    Raises ``ValueError``/``TypeError`` (before any collective) for mismatched shapes, non-bool
    masks, a document without valid tokens or a non-positive temperature.
    """

    def __init__(
        self,
        temperature: float = 0.02,
        normalize_by_query_length: bool = True,
        *,
        gather_across_ranks: bool = True,
        group=None,
        block_elements: int = DEFAULT_BLOCK_ELEMENTS,
    ) -> None:
        super().__init__(normalize_by_query_length, gather_across_ranks, group, block_elements)
        _check_temperature(temperature)
        self.temperature = temperature

    def _terms(self, scores, labels, repeats_dropped, masked):
        logits = scores / self.temperature
        if masked is not None:
            logits = logits.masked_fill(masked, float("-inf"))
        return cross_entropy_terms(logits, labels)


class PairwiseLoss(_MultiVectorLoss):
    """ColPali pairwise loss: ``softplus(hardest negative score - positive score)`` per query.

    Same arguments, candidates, gathers and masking as :class:`LateInteractionLoss`; the hardest
    negative is the best-scoring candidate other than the query's own positive (in-batch
    positives of other queries and all hard negatives of the global batch). No temperature;
    scores are unnormalised MaxSim sums by default, as in ColPali (Faysse et al. 2024).
    Raises ``ValueError`` when the global batch offers no negative (one pair, no hard negative);
    when ``valid`` was given and dropping the repeats left no negative, each query's term is 0
    (nothing to push away), with zero gradient.
    """

    def __init__(
        self,
        normalize_by_query_length: bool = False,
        *,
        gather_across_ranks: bool = True,
        group=None,
        block_elements: int = DEFAULT_BLOCK_ELEMENTS,
    ) -> None:
        super().__init__(normalize_by_query_length, gather_across_ranks, group, block_elements)

    def _terms(self, scores, labels, repeats_dropped, masked):
        return pairwise_terms(scores, labels, allow_no_negative=repeats_dropped, exclude=masked)

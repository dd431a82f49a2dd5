"""Naive single-process references for the contrastive losses (float64, dense, no blocking).

Written independently of ``raggedvl.losses``: explicit candidate matrices, dense 4-D MaxSim,
``logsumexp`` cross-entropy. Used by tier 1 (math), tier 2 (rank simulation) and tier 3 (gloo)
tests as the ground truth on the concatenated global batch.
"""

from __future__ import annotations

import torch


def maxsim(q, qmask, d, dmask):
    """Dense MaxSim: [n_q, Lq, D] x [n_d, Ld, D] -> [n_q, n_d]; pads masked with -inf / 0."""
    sim = torch.einsum("ild,jmd->ijlm", q, d)
    sim = sim.masked_fill(~dmask[None, :, None, :], float("-inf"))
    best = sim.amax(dim=-1)
    best = torch.where(qmask[:, None, :], best, torch.zeros_like(best))
    return best.sum(dim=-1)


def relevance_mask(pos_keys, cand_keys, query_keys=None, extra=None):
    """False negatives by explicit loops: ``[N, C]`` bool, True where candidate c is a document
    relevant to query i (its own positive's key, one of its ``extra[i]`` keys, or those of any
    query with the same query key) and c is not query i's own positive column i."""
    n, c = len(pos_keys), len(cand_keys)
    extra = extra or [[] for _ in range(n)]
    mask = torch.zeros(n, c, dtype=torch.bool)
    for i in range(n):
        same = [j for j in range(n) if (query_keys is None and j == i)
                or (query_keys is not None and int(query_keys[j]) == int(query_keys[i]))]
        relevant = {int(pos_keys[j]) for j in same} | {int(key) for j in same for key in extra[j]}
        for col in range(c):
            mask[i, col] = col != i and int(cand_keys[col]) in relevant
    return mask


def document_relevance_mask(pos_keys, query_keys=None, extra=None):
    """Document-to-query false negatives by loops: ``[N, N]``, True where document i (query i's
    positive) is relevant to query j != i."""
    full = relevance_mask(pos_keys, pos_keys, query_keys, extra)  # [query j, document i]
    return full.T.clone()


def _ce_mean(logits, labels, mask=None):
    if mask is not None:
        logits = logits.masked_fill(mask, float("-inf"))
    picked = logits[torch.arange(len(labels)), labels]
    return (torch.logsumexp(logits, dim=1) - picked).mean()


def info_nce(q, d, negs=None, scale=50.0, symmetric=False, mask=None, d2q_mask=None):
    """Mean InfoNCE of N queries over [N positives, M negatives]; optional doc->query term;
    ``mask`` [N, N+M] / ``d2q_mask`` [N, N]: candidates removed from the denominators."""
    cands = d if negs is None else torch.cat([d, negs])
    labels = torch.arange(q.shape[0])
    loss = _ce_mean(q @ cands.T * scale, labels, mask)
    if symmetric:
        loss = 0.5 * (loss + _ce_mean(d @ q.T * scale, labels, d2q_mask))
    return loss


def _li_scores(q, qmask, d, dmask, negs, nmask, normalize):
    scores = maxsim(q, qmask, d, dmask)
    if negs is not None:
        scores = torch.cat([scores, maxsim(q, qmask, negs, nmask)], dim=1)
    if normalize:
        scores = scores / qmask.sum(dim=1, keepdim=True).clamp(min=1)
    return scores


def late_interaction(q, qmask, d, dmask, negs=None, nmask=None, temperature=0.02, normalize=True, mask=None):
    scores = _li_scores(q, qmask, d, dmask, negs, nmask, normalize)
    return _ce_mean(scores / temperature, torch.arange(q.shape[0]), mask)


def pairwise(q, qmask, d, dmask, negs=None, nmask=None, normalize=False, mask=None):
    scores = _li_scores(q, qmask, d, dmask, negs, nmask, normalize)
    n = q.shape[0]
    pos = scores[torch.arange(n), torch.arange(n)]
    others = scores.clone()
    others[torch.arange(n), torch.arange(n)] = float("-inf")
    if mask is not None:
        others = others.masked_fill(mask, float("-inf"))
    return torch.nn.functional.softplus(others.max(dim=1).values - pos).mean()


def pad_tokens(parts, masks):
    """Concatenate per-rank [n_r, L_r, D] tensors (and masks) padded to max L with zeros/False."""
    width = max(p.shape[1] for p in parts)
    out, out_mask = [], []
    for p, m in zip(parts, masks):
        grow = width - p.shape[1]
        out.append(torch.nn.functional.pad(p, (0, 0, 0, grow)))
        out_mask.append(torch.nn.functional.pad(m, (0, grow), value=False))
    return torch.cat(out), torch.cat(out_mask)

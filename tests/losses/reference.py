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


def _ce_mean(logits, labels):
    picked = logits[torch.arange(len(labels)), labels]
    return (torch.logsumexp(logits, dim=1) - picked).mean()


def info_nce(q, d, negs=None, scale=50.0, symmetric=False):
    """Mean InfoNCE of N queries over [N positives, M negatives]; optional doc->query term."""
    cands = d if negs is None else torch.cat([d, negs])
    labels = torch.arange(q.shape[0])
    loss = _ce_mean(q @ cands.T * scale, labels)
    if symmetric:
        loss = 0.5 * (loss + _ce_mean(d @ q.T * scale, labels))
    return loss


def _li_scores(q, qmask, d, dmask, negs, nmask, normalize):
    scores = maxsim(q, qmask, d, dmask)
    if negs is not None:
        scores = torch.cat([scores, maxsim(q, qmask, negs, nmask)], dim=1)
    if normalize:
        scores = scores / qmask.sum(dim=1, keepdim=True).clamp(min=1)
    return scores


def late_interaction(q, qmask, d, dmask, negs=None, nmask=None, temperature=0.02, normalize=True):
    scores = _li_scores(q, qmask, d, dmask, negs, nmask, normalize)
    return _ce_mean(scores / temperature, torch.arange(q.shape[0]))


def pairwise(q, qmask, d, dmask, negs=None, nmask=None, normalize=False):
    scores = _li_scores(q, qmask, d, dmask, negs, nmask, normalize)
    n = q.shape[0]
    pos = scores[torch.arange(n), torch.arange(n)]
    others = scores.clone()
    others[torch.arange(n), torch.arange(n)] = float("-inf")
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

"""Tier 3: real gloo processes (W = 2 and W = 3), DDP-wrapped encoders, unequal per-rank batches.

Every rank builds the same seeded global batch, encodes its own slice with a DDP-wrapped
float64 encoder and backpropagates its loss share L_r. The single-process reference encodes the
concatenated global batch with an identical unwrapped copy and evaluates the naive loss of
``tests/losses/reference.py``. Claims: sum_r L_r / W equals the reference loss and every
parameter gradient after DDP's average equals the reference gradient, within 1e-10.
Cases C05 (one different pair per rank) and C06 (700 vs 300 document vectors); the "false
negatives" cases pass document and query keys with duplicates across ranks, and the reference
removes the same (query, candidate) pairs, found by explicit loops.
"""

import copy

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from raggedvl.losses import InfoNCELoss, LateInteractionLoss, PairwiseLoss
from tests.dist.harness import run_distributed
from tests.losses import reference as ref

f64 = torch.float64
FEAT, DIM = 5, 4
TOL = 1e-10


def _mlp(out_dim=DIM):
    return nn.Sequential(nn.Linear(FEAT, 6), nn.Tanh(), nn.Linear(6, out_dim)).double()


class _Pipeline(nn.Module):
    """Query and document encoders plus the loss, so DDP also averages a learnable scale."""

    def __init__(self, loss: nn.Module):
        super().__init__()
        self.q_enc, self.d_enc, self.loss = _mlp(), _mlp(), loss

    def embed(self, qf, df, nf, masks=None):
        q, d = self.q_enc(qf), self.d_enc(df)
        n = self.d_enc(nf) if nf is not None else None
        if masks is None:
            return q, d, n
        qm, dm, nm = masks
        q, d = q * qm[..., None], d * dm[..., None]
        if n is not None:
            n = n * nm[..., None]
        return q, qm, d, dm, n, nm

    def forward(self, qf, df, nf, masks=None, **keys):
        if masks is None:
            return self.loss(*self.embed(qf, df, nf), **keys)
        return self.loss(*self.embed(qf, df, nf, masks), **keys)


def _neg_counts(cfg, rank):
    """Hard negatives of each query on ``rank``: ``neg_counts`` (per rank, per query) when the
    case has ragged negatives, else ``k`` per query (an int, or a per-rank list)."""
    if "neg_counts" in cfg:
        return cfg["neg_counts"][rank]
    k = cfg["k"][rank] if isinstance(cfg["k"], list) else cfg["k"]
    return [k] * cfg["counts"][rank]


def _k(cfg, rank):
    """Hard negatives on ``rank`` per query (fixed k) or in all (ragged)."""
    counts = _neg_counts(cfg, rank)
    return sum(counts) if "neg_counts" in cfg else (counts[0] if counts else 0)


def _rank_data(cfg, rank, n, doc_len, neg_len):
    rank_seed = 1000 * cfg["seed"] + rank
    g = torch.Generator().manual_seed(rank_seed)
    multi = cfg["loss"] != "infonce"
    m = sum(_neg_counts(cfg, rank))
    q_shape, d_shape, n_shape = ((n, 3), (n, doc_len), (m, neg_len)) if multi else (
        (n,), (n,), (m,))
    feats = [torch.randn(*s, FEAT, generator=g, dtype=f64) for s in (q_shape, d_shape, n_shape)]
    if not multi:
        return feats, None
    masks = [torch.rand(*s, generator=g) > 0.25 for s in (q_shape, d_shape, n_shape)]
    for m in masks[1:]:
        if m.shape[1]:
            m[:, rank_seed % m.shape[1]] = True  # every document keeps a real vector
    return feats, masks


def _make_loss(cfg, gather):
    kind = cfg["loss"]
    if kind == "infonce":
        return InfoNCELoss(0.2, symmetric=cfg.get("symmetric", False),
                           learnable_scale=cfg.get("learnable", False), gather_across_ranks=gather)
    if kind == "late":
        return LateInteractionLoss(0.3, gather_across_ranks=gather, block_elements=257)
    return PairwiseLoss(gather_across_ranks=gather)


def _keys(cfg, world):
    """Per-rank document and query keys with duplicates inside and across ranks: positive g has
    page g % 3, hard negative j page (2 j) % 5 (pages 0-2 are also positives), queries g and g + 1
    share their text when g is even. With ``relevant``, query g also names pages
    ``(g + 1) % 5 ..`` (g % 3 of them) as further positives. Ragged cases pass ``neg_counts``.
    None when the case has no keys."""
    if not cfg.get("keys"):
        return None
    per_rank, start, neg_start = [], 0, 0
    for r in range(world):
        n, m = cfg["counts"][r], sum(_neg_counts(cfg, r))
        g = torch.arange(start, start + n)
        keys = dict(doc_keys=g % 3, query_keys=g // 2, neg_keys=(2 * torch.arange(neg_start, neg_start + m)) % 5)
        if "neg_counts" in cfg:
            keys["neg_counts"] = torch.tensor(_neg_counts(cfg, r), dtype=torch.int64)
        if cfg.get("relevant"):
            extra = [[(q + 1 + i) % 5 for i in range(q % 3)] for q in g.tolist()]
            keys["relevant_keys"] = torch.tensor([key for e in extra for key in e], dtype=torch.int64)
            keys["relevant_counts"] = torch.tensor([len(e) for e in extra], dtype=torch.int64)
            keys["extra"] = extra
        per_rank.append(keys)
        start, neg_start = start + n, neg_start + m
    return per_rank


def _reference_mask(cfg, keys):
    if keys is None:
        return {}
    pos, negs, queries = (torch.cat([k[name] for k in keys]) for name in ("doc_keys", "neg_keys", "query_keys"))
    extra = [e for k in keys for e in k["extra"]] if cfg.get("relevant") else None
    mask = ref.relevance_mask(pos, torch.cat([pos, negs]), queries, extra)
    if not mask.any():
        raise AssertionError(f"{cfg['name']}: test data too weak, nothing to mask")
    if extra is not None and torch.equal(mask, ref.relevance_mask(pos, torch.cat([pos, negs]), queries)):
        raise AssertionError(f"{cfg['name']}: test data too weak, the further positives mask nothing more")
    return dict(mask=mask, d2q_mask=ref.document_relevance_mask(pos, queries, extra))


def _reference_loss(model, cfg, global_feats, global_masks, masks=None):
    masks = masks or {}
    if cfg["loss"] == "infonce":
        q, d, n = model.embed(*global_feats)
        n = n if n.shape[0] else None
        return ref.info_nce(q, d, n, scale=model.loss.logit_scale(), symmetric=cfg.get("symmetric", False), **masks)
    q, qm, d, dm, n, nm = model.embed(*global_feats, global_masks)
    n, nm = (n, nm) if n.shape[0] else (None, None)
    mask = masks.get("mask")
    if cfg["loss"] == "late":
        return ref.late_interaction(q, qm, d, dm, n, nm, temperature=0.3, mask=mask)
    return ref.pairwise(q, qm, d, dm, n, nm, mask=mask)


def _global_batch(cfg, world):
    """Per-rank data of every rank (identical on all ranks), then the concatenation."""
    per_rank = [
        _rank_data(cfg, r, cfg["counts"][r], cfg["doc_len"][r], cfg["neg_len"][r])
        for r in range(world)
    ]
    if cfg["loss"] == "infonce":
        return per_rank, [torch.cat([p[0][i] for p in per_rank]) for i in range(3)], None
    feats, masks = [], []
    for i in range(3):
        f, m = ref.pad_tokens([p[0][i] for p in per_rank], [p[1][i] for p in per_rank])
        feats.append(f)
        masks.append(m)
    return per_rank, feats, masks


def _check(rank, world, cfg):
    torch.manual_seed(cfg["seed"])
    model = _Pipeline(_make_loss(cfg, gather=True)).double()
    reference = copy.deepcopy(model)
    reference.loss = _make_loss(cfg, gather=False).double()
    reference.loss.load_state_dict(model.loss.state_dict())
    per_rank, global_feats, global_masks = _global_batch(cfg, world)
    feats, masks = per_rank[rank]
    if not _k(cfg, rank):
        feats = [feats[0], feats[1], None]
        masks = None if masks is None else [masks[0], masks[1], None]
    keys = _keys(cfg, world)
    local_keys = {} if keys is None else dict(keys[rank])
    local_keys.pop("extra", None)
    if keys is not None and not _k(cfg, rank):
        local_keys.pop("neg_keys")
    ddp = DistributedDataParallel(model)
    local = ddp(*feats, **local_keys) if masks is None else ddp(*feats, masks, **local_keys)
    local.backward()
    ref_masks = _reference_mask(cfg, keys)
    expected = _reference_loss(reference, cfg, global_feats, global_masks, ref_masks)
    expected.backward()
    grad_err = max(
        (p.grad - r.grad).abs().max().item() for p, r in zip(model.parameters(), reference.parameters())
    )
    if ref_masks:  # this rank's count of masked pairs = the reference mask's rows of its queries
        start = sum(cfg["counts"][:rank])
        expected_count = int(ref_masks["mask"][start:start + cfg["counts"][rank]].sum())
        if int(model.loss.false_negatives) != expected_count:
            raise AssertionError(f"{cfg['name']}: rank {rank} counted {int(model.loss.false_negatives)} "
                                 f"false negatives, the reference {expected_count}")
    return cfg["name"], local.item(), expected.item(), grad_err


def _negative_documents_check(rank, world):
    """C06 with teeth: rank 1's 300-vector document has only negative similarities, and the
    gather pads it to 700 with zero vectors; a zero pad winning MaxSim would change the loss."""
    g = torch.Generator().manual_seed(77)
    q = torch.zeros(world, 2, DIM, dtype=f64)
    q[..., 0] = 1.0  # every query token is e1: a score is the first coordinate of the winner
    lengths = [700, 300]
    docs = [torch.randn(1, n, DIM, generator=g, dtype=f64) for n in lengths]
    docs[1][..., 0] = -docs[1][..., 0].abs() - 0.1
    qm = torch.ones(world, 2, dtype=torch.bool)
    masks = [torch.ones(1, n, dtype=torch.bool) for n in lengths]
    local = docs[rank].clone().requires_grad_(True)
    share = LateInteractionLoss(0.5)(q[rank:rank + 1], qm[rank:rank + 1], local, masks[rank])
    share.backward()
    all_docs, all_masks = ref.pad_tokens(docs, masks)
    all_docs.requires_grad_(True)
    expected = ref.late_interaction(q, qm, all_docs, all_masks, temperature=0.5)
    (ref_grad,) = torch.autograd.grad(expected, all_docs)
    zero_pads_win = ref.late_interaction(q, qm, all_docs, torch.ones_like(all_masks), temperature=0.5)
    if abs(zero_pads_win.item() - expected.item()) < 1e-3:
        raise AssertionError("test data too weak: zero pads would not change the loss")
    # no DDP here: local.grad = d(sum_r L_r)/d local = W * dL/d local
    grad_err = (local.grad / world - ref_grad[rank:rank + 1, : lengths[rank]]).abs().max().item()
    return "C06 negative-only document vs zero pads", share.item(), expected.item(), grad_err


def _run_all(rank, world, configs):
    extra = [_negative_documents_check(rank, world)] if world == 2 else []
    return [_check(rank, world, cfg) for cfg in configs] + extra


def _cfg(name, loss, counts, k, doc_len=None, neg_len=None, **extra):
    world = len(counts)
    return dict(name=name, loss=loss, counts=counts, k=k, seed=len(name) * 7 + sum(counts),
                doc_len=doc_len or [0] * world, neg_len=neg_len or [0] * world, **extra)


W2 = [
    _cfg("C05 infonce one pair per rank", "infonce", [1, 1], 0),
    _cfg("infonce symmetric learnable negs", "infonce", [2, 1], 2, symmetric=True, learnable=True),
    _cfg("infonce empty rank", "infonce", [2, 0], 1),
    _cfg("C06 late interaction 700 vs 300", "late", [2, 1], 0, doc_len=[700, 300]),
    _cfg("late interaction negs", "late", [1, 2], 2, doc_len=[5, 9], neg_len=[4, 7]),
    _cfg("pairwise negs", "pairwise", [2, 1], 1, doc_len=[6, 3], neg_len=[2, 5]),
    _cfg("infonce negs on rank 0 only", "infonce", [1, 2], [2, 0]),
    _cfg("late interaction negs on rank 1 only", "late", [2, 2], [0, 1], doc_len=[4, 6], neg_len=[0, 3]),
    _cfg("infonce symmetric false negatives", "infonce", [3, 2], 1, symmetric=True, keys=True),
    _cfg("late interaction false negatives", "late", [2, 3], 2, doc_len=[5, 9], neg_len=[4, 7], keys=True),
    _cfg("pairwise false negatives", "pairwise", [3, 2], [1, 0], doc_len=[6, 3], neg_len=[2, 0], keys=True),
    _cfg("infonce symmetric several positives ragged negatives", "infonce", [3, 2], 0, symmetric=True, keys=True,
         relevant=True, neg_counts=[[0, 1, 3], [3, 0]]),
    _cfg("late interaction several positives ragged negatives", "late", [3, 2], 0, doc_len=[5, 9], neg_len=[4, 7],
         keys=True, relevant=True, neg_counts=[[1, 0, 3], [0, 1]]),
]
W3 = [
    _cfg("infonce negs", "infonce", [3, 1, 2], 2),
    _cfg("infonce symmetric", "infonce", [3, 1, 2], 0, symmetric=True),
    _cfg("infonce symmetric learnable negs", "infonce", [3, 1, 2], 1, symmetric=True, learnable=True),
    _cfg("late interaction", "late", [3, 1, 2], 0, doc_len=[6, 11, 3]),
    _cfg("late interaction negs", "late", [3, 1, 2], 2, doc_len=[6, 11, 3], neg_len=[3, 8, 1]),
    _cfg("pairwise", "pairwise", [3, 1, 2], 0, doc_len=[4, 2, 7]),
    _cfg("pairwise negs", "pairwise", [3, 1, 2], 2, doc_len=[4, 2, 7], neg_len=[5, 5, 2]),
    _cfg("infonce false negatives", "infonce", [3, 1, 2], [1, 0, 2], keys=True),
    _cfg("late interaction false negatives", "late", [3, 1, 2], 1, doc_len=[6, 11, 3], neg_len=[3, 8, 1], keys=True),
    _cfg("infonce several positives ragged negatives", "infonce", [3, 1, 2], 0, keys=True, relevant=True,
         neg_counts=[[3, 0, 1], [0], [1, 3]]),
    _cfg("late interaction several positives ragged negatives", "late", [3, 1, 2], 0, doc_len=[6, 11, 3],
         neg_len=[3, 8, 1], keys=True, relevant=True, neg_counts=[[0, 1, 3], [0], [3, 1]]),
    _cfg("pairwise several positives ragged negatives", "pairwise", [3, 1, 2], 0, doc_len=[4, 2, 7],
         neg_len=[5, 5, 2], keys=True, relevant=True, neg_counts=[[1, 3, 0], [1], [0, 0]]),
]


def _assert_exact(results, world):
    by_name = {}
    for rank_results in results:
        for name, local, expected, grad_err in rank_results:
            by_name.setdefault(name, []).append((local, expected, grad_err))
    assert len(by_name) == len(results[0])
    for name, rows in by_name.items():
        shares = [r[0] for r in rows]
        expected = rows[0][1]
        assert abs(sum(shares) / world - expected) < TOL, (name, shares, expected)
        assert all(abs(r[1] - expected) < 1e-12 for r in rows), name
        assert max(r[2] for r in rows) < TOL, (name, [r[2] for r in rows])


@pytest.mark.dist
def test_losses_match_single_process_on_two_ranks():
    _assert_exact(run_distributed(_run_all, 2, W2), 2)


@pytest.mark.dist
def test_losses_match_single_process_on_three_unequal_ranks_with_hard_negatives():
    _assert_exact(run_distributed(_run_all, 3, W3), 3)

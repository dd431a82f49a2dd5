"""Tier 1: loss modules on one process (no group) against the naive float64 references."""

import math

import pytest
import torch

from raggedvl.losses import InfoNCELoss, LateInteractionLoss, PairwiseLoss, pairwise_terms
from tests.losses import reference as ref

f64 = torch.float64


def _bi(seed, n=5, k=0, dim=6):
    g = torch.Generator().manual_seed(seed)
    q, d = torch.randn(n, dim, generator=g, dtype=f64), torch.randn(n, dim, generator=g, dtype=f64)
    negs = torch.randn(n * k, dim, generator=g, dtype=f64) if k else None
    return q, d, negs


def _mv(seed, n=4, k=0, l_q=5, l_d=8, l_n=6, dim=3):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, l_q, dim, generator=g, dtype=f64)
    d = torch.randn(n, l_d, dim, generator=g, dtype=f64)
    qm, dm = torch.rand(n, l_q, generator=g) > 0.3, torch.rand(n, l_d, generator=g) > 0.3
    qm[:, 0], dm[:, 0] = True, True
    negs = nm = None
    if k:
        negs = torch.randn(n * k, l_n, dim, generator=g, dtype=f64)
        nm = torch.rand(n * k, l_n, generator=g) > 0.3
        nm[:, -1] = True
    return q, qm, d, dm, negs, nm


@pytest.mark.parametrize("k", [0, 2])
@pytest.mark.parametrize("symmetric", [False, True])
def test_info_nce_matches_reference(k, symmetric):
    q, d, negs = _bi(k + 10 * symmetric, k=k)
    q.requires_grad_(True)
    loss = InfoNCELoss(temperature=0.1, symmetric=symmetric)(q, d, negs)
    expected = ref.info_nce(q, d, negs, scale=10.0, symmetric=symmetric)
    torch.testing.assert_close(loss, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(*[torch.autograd.grad(v, q)[0] for v in (loss, expected)])


def test_learnable_scale_multiplies_and_clamps():
    q, d, negs = _bi(1, k=1)
    loss_fn = InfoNCELoss(temperature=0.05, learnable_scale=True, max_logit_scale=30.0)
    assert loss_fn.logit_scale().item() == pytest.approx(20.0)
    loss = loss_fn(q, d, negs)
    torch.testing.assert_close(loss, ref.info_nce(q, d, negs, scale=20.0))
    (grad,) = torch.autograd.grad(loss, loss_fn.log_logit_scale)
    assert grad.item() != 0
    with torch.no_grad():
        loss_fn.log_logit_scale.fill_(math.log(500.0))
    clamped = loss_fn(q, d, negs)
    torch.testing.assert_close(clamped, ref.info_nce(q, d, negs, scale=30.0))
    assert torch.autograd.grad(clamped, loss_fn.log_logit_scale)[0].item() == 0.0
    with pytest.raises(ValueError, match="exceeds max_logit_scale"):
        InfoNCELoss(temperature=0.001, learnable_scale=True)


@pytest.mark.parametrize("k", [0, 3])
@pytest.mark.parametrize("normalize", [True, False])
def test_late_interaction_matches_reference(k, normalize):
    q, qm, d, dm, negs, nm = _mv(k + normalize, k=k)
    d.requires_grad_(True)
    loss = LateInteractionLoss(temperature=0.5, normalize_by_query_length=normalize)(q, qm, d, dm, negs, nm)
    expected = ref.late_interaction(q, qm, d, dm, negs, nm, temperature=0.5, normalize=normalize)
    torch.testing.assert_close(loss, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(*[torch.autograd.grad(v, d)[0] for v in (loss, expected)])


def test_late_interaction_query_without_tokens_gives_log_candidates():
    q, qm, d, dm, negs, nm = _mv(3, n=1, k=2)
    qm[:] = False
    loss = LateInteractionLoss()(q, qm, d, dm, negs, nm)
    assert loss.item() == pytest.approx(math.log(3))


@pytest.mark.parametrize("k", [0, 1])
def test_pairwise_matches_reference(k):
    q, qm, d, dm, negs, nm = _mv(20 + k, k=k)
    q.requires_grad_(True)
    loss = PairwiseLoss()(q, qm, d, dm, negs, nm)
    expected = ref.pairwise(q, qm, d, dm, negs, nm)
    torch.testing.assert_close(loss, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(*[torch.autograd.grad(v, q)[0] for v in (loss, expected)])


def test_pairwise_terms_pick_hardest_other_candidate():
    scores = torch.tensor([[1.0, 3.0, 2.0], [0.5, 0.0, -1.0]], dtype=f64)
    terms = pairwise_terms(scores, torch.tensor([1, 0]))
    expected = torch.nn.functional.softplus(torch.tensor([2.0 - 3.0, 0.0 - 0.5], dtype=f64))
    torch.testing.assert_close(terms, expected)
    with pytest.raises(ValueError, match="at least 2 candidates"):
        pairwise_terms(scores[:, :1], torch.tensor([0, 0]))


def test_input_errors_name_the_numbers():
    q, d, _ = _bi(2, n=4)
    with pytest.raises(ValueError, match="7 rows for 4 queries"):
        InfoNCELoss()(q, d, torch.zeros(7, q.shape[1], dtype=f64))
    with pytest.raises(ValueError, match="same shape"):
        InfoNCELoss()(q, d[:3])
    with pytest.raises(ValueError, match="temperature must be > 0"):
        InfoNCELoss(temperature=0)
    mq, mqm, md, mdm, _, _ = _mv(2)
    with pytest.raises(ValueError, match="together"):
        LateInteractionLoss()(mq, mqm, md, mdm, md)
    mdm[1] = False
    with pytest.raises(ValueError, match=r"documents \[1\]"):
        PairwiseLoss()(mq, mqm, md, mdm)

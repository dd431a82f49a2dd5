"""Tier 1: blocked MaxSim against the dense float64 reference, masking and edge cases."""

import pytest
import torch

from raggedvl.losses import check_late_interaction_inputs, late_interaction_scores
from tests.losses.reference import maxsim

f64 = torch.float64


def _inputs(seed, n_q=5, l_q=7, n_d=6, l_d=9, dim=4):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n_q, l_q, dim, generator=g, dtype=f64, requires_grad=True)
    d = torch.randn(n_d, l_d, dim, generator=g, dtype=f64, requires_grad=True)
    qm = torch.rand(n_q, l_q, generator=g) > 0.3
    dm = torch.rand(n_d, l_d, generator=g) > 0.4
    dm[:, -1] = True  # every document keeps a real token (left padding for some)
    return q, qm, d, dm


@pytest.mark.parametrize("block", [1, 13, 200, 1 << 23])
def test_values_and_gradients_match_dense_reference(block):
    q, qm, d, dm = _inputs(block)
    scores = late_interaction_scores(q, qm, d, dm, block_elements=block)
    upstream = torch.randn_like(scores)
    gq, gd = torch.autograd.grad(scores, (q, d), upstream)
    ref = maxsim(q, qm, d, dm)
    rq, rd = torch.autograd.grad(ref, (q, d), upstream)
    torch.testing.assert_close(scores, ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(gq, rq, rtol=0, atol=1e-12)
    torch.testing.assert_close(gd, rd, rtol=0, atol=1e-12)


def test_no_grad_path_gives_same_scores():
    q, qm, d, dm = _inputs(3)
    with torch.no_grad():
        plain = late_interaction_scores(q, qm, d, dm, block_elements=17)
    torch.testing.assert_close(plain, maxsim(q, qm, d, dm).detach(), rtol=0, atol=1e-12)


def test_zero_padding_never_beats_negative_similarities():
    # the document's real tokens all point away from the query: every real similarity < 0
    q = torch.tensor([[[1.0, 0.0]]], dtype=f64)
    qm = torch.ones(1, 1, dtype=torch.bool)
    d = torch.tensor([[[-1.0, 0.0], [-0.5, 0.5], [0.0, 0.0], [0.0, 0.0]]], dtype=f64)
    dm = torch.tensor([[True, True, False, False]])
    score = late_interaction_scores(q, qm, d, dm)
    assert score.item() == pytest.approx(-0.5, abs=1e-15)  # the true best real similarity
    # a zero-vector pad treated as a token would have won with 0
    assert late_interaction_scores(q, qm, d, torch.ones_like(dm)).item() == 0.0


def test_query_without_valid_tokens_scores_zero_without_nan():
    q, qm, d, dm = _inputs(4)
    qm[1] = False
    scores = late_interaction_scores(q, qm, d, dm, block_elements=11)
    gq, gd = torch.autograd.grad(scores.sum(), (q, d))
    assert torch.all(scores[1] == 0)
    assert torch.isfinite(gq).all() and torch.isfinite(gd).all()
    assert torch.all(gq[1] == 0)


def test_query_pads_contribute_nothing():
    q, qm, d, dm = _inputs(5)
    before = late_interaction_scores(q, qm, d, dm)
    q2 = q.detach().clone()
    q2[~qm] = 1e6  # garbage in padded query slots
    torch.testing.assert_close(late_interaction_scores(q2, qm, d, dm), before.detach())


def test_document_without_valid_tokens_is_rejected_by_index():
    q, qm, d, dm = _inputs(6)
    dm[2] = False
    with pytest.raises(ValueError, match=r"documents \[2\] have no valid token"):
        late_interaction_scores(q, qm, d, dm)
    check_late_interaction_inputs(q, qm, d, dm, check_empty=False)  # what an accelerator's masks get: no read


@pytest.mark.parametrize(
    "change, error, match",
    [
        (lambda q, qm, d, dm: (q, qm.float(), d, dm), TypeError, "query_mask must be bool"),
        (lambda q, qm, d, dm: (q, qm[:, :3], d, dm), ValueError, "query_mask has shape"),
        (lambda q, qm, d, dm: (q, qm, d[..., :3], dm), ValueError, "differs from document dim"),
        (lambda q, qm, d, dm: (q.float(), qm, d, dm), TypeError, "dtype"),
        (lambda q, qm, d, dm: (q[0], qm, d, dm), ValueError, r"\[n_q, Lq, D\]"),
    ],
)
def test_bad_inputs_raise_readable_errors(change, error, match):
    with pytest.raises(error, match=match):
        late_interaction_scores(*change(*_inputs(7)))


def test_bfloat16_embeddings_score_in_float32():
    q, qm, d, dm = _inputs(8)
    qb, db = q.detach().bfloat16().requires_grad_(True), d.detach().bfloat16().requires_grad_(True)
    scores = late_interaction_scores(qb, qm, db, dm, block_elements=29)
    assert scores.dtype == torch.float32
    gq, gd = torch.autograd.grad(scores.sum(), (qb, db))
    assert gq.dtype == gd.dtype == torch.bfloat16
    q64, d64 = qb.detach().double().requires_grad_(True), db.detach().double().requires_grad_(True)
    expected = maxsim(q64, qm, d64, dm)
    rq, rd = torch.autograd.grad(expected.sum(), (q64, d64))
    torch.testing.assert_close(scores.double(), expected.detach(), rtol=0, atol=5e-2)
    torch.testing.assert_close(gq.double(), rq, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(gd.double(), rd, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_scores_and_gradients_match_cpu_reference():
    q, qm, d, dm = _inputs(9, n_q=12, l_q=16, n_d=20, l_d=300, dim=32)
    cuda = [t.detach().cuda().requires_grad_(t.requires_grad) for t in (q, qm, d, dm)]
    scores = late_interaction_scores(*cuda, block_elements=5000)
    gq, gd = torch.autograd.grad(scores.sum(), (cuda[0], cuda[2]))
    expected = maxsim(q, qm, d, dm)
    rq, rd = torch.autograd.grad(expected.sum(), (q, d))
    torch.testing.assert_close(scores.cpu(), expected.detach(), rtol=0, atol=1e-10)
    torch.testing.assert_close(gq.cpu(), rq, rtol=0, atol=1e-10)
    torch.testing.assert_close(gd.cpu(), rd, rtol=0, atol=1e-10)

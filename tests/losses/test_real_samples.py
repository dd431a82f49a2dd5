"""Tier 1: the ``valid`` mask of every loss drops repeated samples exactly (one process).

A batch whose last samples repeat earlier ones (what accelerate does to complete the last batch)
must give the loss, and the gradient, of the real samples alone: the repeats are neither
queries nor candidates, and their embeddings get exactly zero gradient.
"""

import pytest
import torch

from raggedvl.losses import InfoNCELoss, LateInteractionLoss, PairwiseLoss, real_rows
from tests.losses import reference as ref
from tests.losses.test_losses_math import _bi, _mv

VALID = torch.tensor([True, False, True, True, False])  # samples 1 and 4 repeat others
REAL = VALID.nonzero().flatten()


def test_real_rows_keep_each_real_pair_with_its_hard_negatives():
    pairs, negs = real_rows(VALID, 5, negatives_per_query=2)
    assert pairs.tolist() == [0, 2, 3]
    assert negs.tolist() == [0, 1, 4, 5, 6, 7]
    assert real_rows(torch.zeros(3, dtype=torch.bool), 3)[0].numel() == 0
    with pytest.raises(TypeError, match="bool"):
        real_rows(torch.ones(5), 5)
    with pytest.raises(ValueError, match="batch has 4 samples"):
        real_rows(VALID, 4)


@pytest.mark.parametrize("k", [0, 2])
@pytest.mark.parametrize("symmetric", [False, True])
def test_info_nce_with_repeats_is_the_loss_of_the_real_samples(k, symmetric):
    q, d, negs = _bi(30 + k, k=k)
    d[1], d[4] = d[0], d[2]  # the repeats are copies: they would be the best-scoring negatives
    q.requires_grad_(True)
    d.requires_grad_(True)
    loss = InfoNCELoss(temperature=0.1, symmetric=symmetric)(q, d, negs, valid=VALID)
    real_negs = None if negs is None else negs.view(5, k, -1)[REAL].reshape(-1, negs.shape[1])
    expected = ref.info_nce(q[REAL], d[REAL], real_negs, scale=10.0, symmetric=symmetric)
    torch.testing.assert_close(loss, expected, rtol=0, atol=1e-12)
    for got, want in zip(torch.autograd.grad(loss, (q, d)), torch.autograd.grad(expected, (q, d))):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
        assert torch.count_nonzero(got[~VALID]) == 0


@pytest.mark.parametrize("loss_fn", [LateInteractionLoss(temperature=0.5), PairwiseLoss()], ids=["late", "pairwise"])
@pytest.mark.parametrize("k", [0, 1])
def test_multi_vector_losses_with_repeats_are_the_loss_of_the_real_samples(loss_fn, k):
    q, qm, d, dm, negs, nm = _mv(40 + k, n=5, k=k)
    q.requires_grad_(True)
    d.requires_grad_(True)
    loss = loss_fn(q, qm, d, dm, negs, nm, valid=VALID)
    rn = rm = None
    if k:
        rn, rm = negs.view(5, k, *negs.shape[1:])[REAL].flatten(0, 1), nm.view(5, k, -1)[REAL].flatten(0, 1)
    if isinstance(loss_fn, PairwiseLoss):
        expected = ref.pairwise(q[REAL], qm[REAL], d[REAL], dm[REAL], rn, rm)
    else:
        expected = ref.late_interaction(q[REAL], qm[REAL], d[REAL], dm[REAL], rn, rm, temperature=0.5)
    torch.testing.assert_close(loss, expected, rtol=0, atol=1e-12)
    for got, want in zip(torch.autograd.grad(loss, (q, d)), torch.autograd.grad(expected, (q, d))):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
        assert torch.count_nonzero(got[~VALID]) == 0


def test_one_real_pair_has_no_negative():
    """The streaming case: one real pair and its repeat give 0, not log 2."""
    q, qm, d, dm, _, _ = _mv(7, n=2)
    d[1], dm[1], q[1], qm[1] = d[0], dm[0], q[0], qm[0]
    d.requires_grad_(True)
    valid = torch.tensor([True, False])
    for loss_fn in (LateInteractionLoss(), PairwiseLoss()):
        loss = loss_fn(q, qm, d, dm, valid=valid)
        assert loss.item() == 0.0
        assert torch.count_nonzero(torch.autograd.grad(loss, d)[0]) == 0
    assert LateInteractionLoss()(q, qm, d, dm).item() == pytest.approx(0.6931, abs=1e-3)  # log 2 counting the repeat

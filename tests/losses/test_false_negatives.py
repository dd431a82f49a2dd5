"""False negatives (a candidate that is one of the query's own relevant documents) leave the
denominator: masks against explicit loops, losses and gradients against the naive float64
references of ``tests/losses/reference.py``, and the objective's floor with a perfect encoder."""

import math

import pytest
import torch

from raggedvl.losses import InfoNCELoss, LateInteractionLoss, PairwiseLoss
from raggedvl.losses.functional import document_false_negative_mask, false_negative_mask
from tests.losses import reference as ref

f64 = torch.float64
TOL = 1e-12  # float64, same operations in a different order: rounding ~1e-15 per term


def _keys(values):
    return torch.tensor(values, dtype=torch.int64)


@pytest.mark.parametrize("with_query_keys", [False, True])
def test_mask_equals_explicit_loops(with_query_keys):
    g = torch.Generator().manual_seed(3)
    n, m = 9, 7
    pos = torch.randint(0, 5, (n,), generator=g)
    negs = torch.randint(0, 8, (m,), generator=g)
    queries = torch.randint(0, 4, (n,), generator=g) if with_query_keys else None
    cands = torch.cat([pos, negs])
    expected = ref.relevance_mask(pos, cands, queries)
    assert expected.any(), "test data too weak: nothing to mask"
    for start, stop in [(0, 4), (4, 9)]:  # two ranks' local queries
        labels = torch.arange(start, stop)
        local_q = None if queries is None else queries[start:stop]
        got = false_negative_mask(labels, pos, cands, query_keys=local_q, all_query_keys=queries)
        assert torch.equal(got, expected[start:stop])
        docs = document_false_negative_mask(labels, pos, queries)
        assert torch.equal(docs, ref.document_relevance_mask(pos, queries)[start:stop])


def _perfect_batch():
    """Three queries; queries 0 and 1 ask about the same page (key 7), query 2 about page 8.
    Every query vector equals its page's vector, so a perfect encoder scores its pages 1 and
    every other page 0."""
    page = {7: torch.tensor([1.0, 0.0], dtype=f64), 8: torch.tensor([0.0, 1.0], dtype=f64)}
    keys = [7, 7, 8]
    q = torch.stack([page[k] for k in keys])
    return q, q.clone(), _keys(keys)


@pytest.mark.parametrize("temperature", [0.1, 0.01])
def test_masked_loss_goes_to_zero_with_a_perfect_encoder_while_unmasked_keeps_its_floor(temperature):
    q, d, keys = _perfect_batch()
    loss = InfoNCELoss(temperature)
    kept = loss(q, d).item()
    masked = loss(q, d, doc_keys=keys).item()
    assert loss.false_negatives.item() == 2  # (q0, page of q1) and (q1, page of q0)
    e = math.exp(-1 / temperature)  # a wrong page's weight relative to the right one
    # unmasked: queries 0 and 1 split their mass between two copies of their page (floor 2 ln 2 / 3)
    assert kept == pytest.approx((2 * math.log(2 + e) + math.log1p(2 * e)) / 3, rel=1e-12)
    assert kept >= 2 * math.log(2) / 3
    # masked: every query keeps only the wrong pages' weight, which vanishes as temperature -> 0
    assert masked == pytest.approx((2 * math.log1p(e) + math.log1p(2 * e)) / 3, rel=1e-12)
    li = LateInteractionLoss(temperature)  # one token per query and page: MaxSim = dot product
    ones = torch.ones(3, 1, dtype=torch.bool)
    assert li(q[:, None], ones, d[:, None], ones).item() == pytest.approx(kept, rel=1e-12)
    assert li(q[:, None], ones, d[:, None], ones, doc_keys=keys).item() == pytest.approx(masked, rel=1e-12)


def _random_case(seed, n=6, k=2, length=4):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, 3, 4, generator=g, dtype=f64)
    d = torch.randn(n, length, 4, generator=g, dtype=f64)
    negs = torch.randn(n * k, length, 4, generator=g, dtype=f64)
    qm = torch.rand(n, 3, generator=g) > 0.2
    dm = torch.rand(n, length, generator=g) > 0.2
    nm = torch.rand(n * k, length, generator=g) > 0.2
    dm[:, 0] = nm[:, 0] = True
    pos_keys = _keys([0, 1, 0, 2, 3, 1][:n])
    neg_keys = _keys([(i * 5) % 7 for i in range(n * k)])  # some hit positives 0..3
    query_keys = _keys([0, 1, 2, 0, 4, 5][:n])
    return q, qm, d, dm, negs, nm, pos_keys, neg_keys, query_keys


@pytest.mark.parametrize("kind", ["late", "pairwise"])
@pytest.mark.parametrize("with_query_keys", [False, True])
def test_multi_vector_losses_equal_the_masked_reference(kind, with_query_keys):
    q, qm, d, dm, negs, nm, pos_keys, neg_keys, query_keys = _random_case(11)
    query_keys = query_keys if with_query_keys else None
    mask = ref.relevance_mask(pos_keys, torch.cat([pos_keys, neg_keys]), query_keys)
    assert mask[:, 6:].any() and mask[:, :6].any(), "test data too weak"
    leaves = [t.clone().requires_grad_(True) for t in (q, d, negs)]
    refs = [t.clone().requires_grad_(True) for t in (q, d, negs)]
    if kind == "late":
        loss = LateInteractionLoss(0.3)
        expected = ref.late_interaction(refs[0], qm, refs[1], dm, refs[2], nm, temperature=0.3, mask=mask)
    else:
        loss = PairwiseLoss()
        expected = ref.pairwise(refs[0], qm, refs[1], dm, refs[2], nm, mask=mask)
    got = loss(leaves[0], qm, leaves[1], dm, leaves[2], nm, doc_keys=pos_keys, neg_keys=neg_keys, query_keys=query_keys)
    assert abs(got.item() - expected.item()) < TOL
    assert loss.false_negatives.item() == int(mask.sum())
    got.backward()
    expected.backward()
    for a, b in zip(leaves, refs):
        assert (a.grad - b.grad).abs().max().item() < TOL


@pytest.mark.parametrize("symmetric", [False, True])
def test_infonce_equals_the_masked_reference(symmetric):
    g = torch.Generator().manual_seed(5)
    q, d, negs = (torch.randn(r, 4, generator=g, dtype=f64) for r in (6, 6, 6))
    pos_keys, neg_keys, query_keys = _keys([0, 1, 0, 2, 3, 1]), _keys([1, 9, 2, 8, 0, 7]), _keys([0, 1, 2, 0, 4, 5])
    mask = ref.relevance_mask(pos_keys, torch.cat([pos_keys, neg_keys]), query_keys)
    d2q = ref.document_relevance_mask(pos_keys, query_keys)
    loss = InfoNCELoss(0.5, symmetric=symmetric)
    leaves = [t.clone().requires_grad_(True) for t in (q, d, negs)]
    refs = [t.clone().requires_grad_(True) for t in (q, d, negs)]
    got = loss(*leaves, doc_keys=pos_keys, neg_keys=neg_keys, query_keys=query_keys)
    expected = ref.info_nce(*refs, scale=2.0, symmetric=symmetric, mask=mask, d2q_mask=d2q)
    assert abs(got.item() - expected.item()) < TOL
    got.backward()
    expected.backward()
    for a, b in zip(leaves, refs):
        assert (a.grad - b.grad).abs().max().item() < TOL


def test_keys_of_repeated_samples_leave_with_them():
    q, qm, d, dm, negs, nm, pos_keys, neg_keys, _ = _random_case(2)
    valid = torch.tensor([True, True, False, True, True, False])
    loss = LateInteractionLoss(0.3)
    got = loss(q, qm, d, dm, negs, nm, valid=valid, doc_keys=pos_keys, neg_keys=neg_keys)
    keep = valid.nonzero().flatten()
    keep_negs = (keep[:, None] * 2 + torch.arange(2)).flatten()
    expected = loss(q[keep], qm[keep], d[keep], dm[keep], negs[keep_negs], nm[keep_negs],
                    doc_keys=pos_keys[keep], neg_keys=neg_keys[keep_negs])
    assert got.item() == expected.item()


def test_masked_pairwise_query_without_any_negative_has_zero_term():
    q, d, keys = _perfect_batch()
    ones = torch.ones(3, 1, dtype=torch.bool)
    qq = q[:2, None].clone().requires_grad_(True)
    loss = PairwiseLoss()(qq, ones[:2], d[:2, None], ones[:2], doc_keys=keys[:2])
    assert loss.item() == 0.0
    loss.backward()
    assert torch.equal(qq.grad, torch.zeros_like(qq))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(doc_keys=torch.tensor([0.0, 1.0, 2.0])), "doc_keys must be an int64 tensor [3]"),
        (dict(doc_keys=_keys([0, 1])), "doc_keys must be an int64 tensor [3]"),
        (dict(neg_keys=_keys([0, 1, 2])), "need doc_keys"),
        (dict(doc_keys=_keys([0, 1, 2]), query_keys=_keys([0])), "query_keys must be an int64 tensor [3]"),
    ],
)
def test_bad_keys_are_named(kwargs, message):
    q, d, _ = _perfect_batch()
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        InfoNCELoss(0.1)(q, d, **kwargs)


def test_hard_negatives_need_their_keys():
    q, d, keys = _perfect_batch()
    with pytest.raises(ValueError, match="neg_keys is missing for 3 hard negatives"):
        InfoNCELoss(0.1)(q, d, d.clone(), doc_keys=keys)


def test_repeats_leave_with_their_ragged_negatives_and_relevant_keys():
    """A repeated sample drops exactly its own hard negatives (per-query counts 0, 3, 1, 2) and its
    further relevant keys: the loss equals the loss on the real rows alone, bit for bit (the same
    float64 operations on the same rows), and the relevant keys still mask."""
    from raggedvl.losses import InfoNCELoss

    g = torch.Generator().manual_seed(5)
    q, d = torch.randn(4, 6, generator=g, dtype=torch.float64), torch.randn(4, 6, generator=g, dtype=torch.float64)
    neg_counts = torch.tensor([0, 3, 1, 2])
    negs = torch.randn(6, 6, generator=g, dtype=torch.float64)
    keys = dict(doc_keys=torch.tensor([10, 11, 12, 13]), neg_keys=torch.tensor([20, 21, 12, 22, 23, 24]),
                relevant_keys=torch.tensor([21, 23, 22]), relevant_counts=torch.tensor([1, 0, 1, 1]))
    valid = torch.tensor([True, False, True, True])
    loss = InfoNCELoss(0.5)
    with_repeat = loss(q, d, negs, valid=valid, neg_counts=neg_counts, **keys)
    counted = int(loss.false_negatives)
    real = [0, 2, 3]  # query 1's negatives 0..2 leave; query 2 owns 3, query 3 owns 4, 5
    alone = loss(q[real], d[real], negs[[3, 4, 5]], neg_counts=torch.tensor([0, 1, 2]),
                 doc_keys=keys["doc_keys"][real], neg_keys=keys["neg_keys"][[3, 4, 5]],
                 relevant_keys=torch.tensor([21, 23, 22]), relevant_counts=torch.tensor([1, 1, 1]))
    assert torch.equal(with_repeat, alone)
    # query 0 names 21 (query 1's negative: gone), query 2 names 23 (kept), query 3 names 22 (kept)
    assert counted == int(loss.false_negatives) == 2

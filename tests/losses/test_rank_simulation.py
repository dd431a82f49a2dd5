"""Tier 2: every rank of W in {1, 2, 3, 8} simulated in one process with unequal batch sizes.

Each simulated rank takes its slice of the global batch, builds the candidates exactly as the
gathers would (rank-ordered concatenation of every rank's positives, then of every rank's hard
negatives) and applies the pure functions. The shares must sum to W times the single-process
loss, and their gradients to W times its gradient (what DDP's average turns into the exact one).
"""

import pytest
import torch

from raggedvl.batch import exclusive_cumsum
from raggedvl.losses import (
    cross_entropy_terms,
    global_mean_share,
    late_interaction_scores,
    positive_labels,
)
from tests.losses import reference as ref

f64 = torch.float64
COUNTS = {1: [5], 2: [3, 1], 3: [3, 1, 2], 8: [3, 0, 1, 2, 5, 1, 1, 2]}
K = 2  # hard negatives per query


def _slices(counts):
    return [slice(o, o + c) for o, c in zip(exclusive_cumsum(counts).tolist(), counts)]


def test_exclusive_cumsum_and_labels():
    assert exclusive_cumsum([3, 1, 2]).tolist() == [0, 3, 4]
    assert exclusive_cumsum([]).tolist() == []
    assert exclusive_cumsum(torch.tensor([0, 2, 0, 1])).tolist() == [0, 0, 2, 2]
    assert positive_labels([3, 1, 2], 2).tolist() == [4, 5]  # rank * local_batch: [4, 5] by luck
    assert positive_labels([3, 1, 2], 1).tolist() == [3]  # rank * local_batch would give [1]
    assert positive_labels([3, 0, 2], 1).tolist() == []
    with pytest.raises(ValueError, match="outside"):
        positive_labels([1, 1], 2)
    with pytest.raises(ValueError, match=">= 0"):
        exclusive_cumsum([1, -1])


@pytest.mark.parametrize("world", sorted(COUNTS))
def test_labels_point_at_own_positive_and_negatives_stay_query_major(world):
    counts = COUNTS[world]
    n = sum(counts)
    ids = torch.arange(n)  # global query ids; the positive of query g is document g
    neg_owner = ids.repeat_interleave(K)  # query-major hard negatives of the global batch
    # gathered candidates = per-rank positives (rank order), then per-rank negatives (rank order)
    pos_cols = torch.cat([ids[s] for s in _slices(counts)])
    neg_cols = torch.cat([neg_owner[slice(s.start * K, s.stop * K)] for s in _slices(counts)])
    for rank, s in enumerate(_slices(counts)):
        labels = positive_labels(counts, rank)
        assert torch.equal(pos_cols[labels], ids[s])
        own_negs = neg_cols.view(n, K)[labels]
        assert torch.equal(own_negs, ids[s][:, None].expand(-1, K))


def _bi_data(n, dim=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    make = lambda rows: torch.randn(rows, dim, generator=g, dtype=f64, requires_grad=True)  # noqa: E731
    return make(n), make(n), make(n * K)


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("world", sorted(COUNTS))
def test_info_nce_shares_sum_to_world_times_reference(world, symmetric):
    counts, scale = COUNTS[world], 7.0
    n = sum(counts)
    q, d, negs = _bi_data(n, seed=world)
    total = 0
    for rank, s in enumerate(_slices(counts)):
        labels = positive_labels(counts, rank)
        logits = q[s] @ torch.cat([d, negs]).T * scale
        terms = cross_entropy_terms(logits, labels)
        if symmetric:
            terms = 0.5 * (terms + cross_entropy_terms(d[s] @ q.T * scale, labels))
        total = total + global_mean_share(terms, world, n)
    expected = ref.info_nce(q, d, negs, scale=scale, symmetric=symmetric)
    torch.testing.assert_close(total, world * expected, rtol=0, atol=1e-12)
    for got, want in zip(torch.autograd.grad(total, (q, d, negs)),
                         torch.autograd.grad(world * expected, (q, d, negs))):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("world", sorted(COUNTS))
def test_late_interaction_shares_sum_to_world_times_reference(world):
    counts, temperature = COUNTS[world], 0.3
    n = sum(counts)
    g = torch.Generator().manual_seed(100 + world)
    q = torch.randn(n, 4, 3, generator=g, dtype=f64, requires_grad=True)
    d = torch.randn(n, 6, 3, generator=g, dtype=f64, requires_grad=True)
    negs = torch.randn(n * K, 5, 3, generator=g, dtype=f64, requires_grad=True)
    qm, dm, nm = (torch.rand(t.shape[:2], generator=g) > 0.3 for t in (q, d, negs))
    dm[:, 0], nm[:, 0] = True, True
    total = 0
    for rank, s in enumerate(_slices(counts)):
        scores = torch.cat([late_interaction_scores(q[s], qm[s], d, dm, block_elements=10),
                            late_interaction_scores(q[s], qm[s], negs, nm, block_elements=10)], 1)
        scores = scores / qm[s].sum(1, keepdim=True).clamp(min=1)
        terms = cross_entropy_terms(scores / temperature, positive_labels(counts, rank))
        total = total + global_mean_share(terms, world, n)
    expected = ref.late_interaction(q, qm, d, dm, negs, nm, temperature=temperature)
    torch.testing.assert_close(total, world * expected, rtol=0, atol=1e-12)
    for got, want in zip(torch.autograd.grad(total, (q, d, negs)),
                         torch.autograd.grad(world * expected, (q, d, negs))):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_global_mean_share_rejects_empty_global_batch():
    with pytest.raises(ValueError, match="empty"):
        global_mean_share(torch.zeros(0), 2, 0)

"""Weighted mixing of several datasets: proportions, determinism, resume,
rank agreement and bad weights, simulated for every rank in one process."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from raggedvl.sampling import BalancedDistributedBatchSampler, Mixture

SIZES = (40, 200, 13)  # a small dataset up-weighted, a large one down-weighted


def _ranks(mixture, g, w, seed=0, **kw):
    costs = np.random.default_rng(1).lognormal(0.0, 1.0, mixture.num_samples)
    return [BalancedDistributedBatchSampler(costs, g, w, r, seed=seed, mixture=mixture, **kw) for r in range(w)]


def _global_steps(samplers, epochs):
    """[steps] of the global batch (every rank's indices together), over ``epochs`` epochs."""
    out = []
    for epoch in range(epochs):
        per_rank = []
        for s in samplers:
            s.set_epoch(epoch)
            per_rank.append(list(s))
        assert len({len(r) for r in per_rank}) == 1  # every rank takes the same number of steps
        out.extend([i for part in step for i in part] for step in zip(*per_rank))
    return out


def _dataset_of(index, mixture):
    return int(np.searchsorted(mixture.offsets(), index, side="right") - 1)


@pytest.mark.parametrize("w", [1, 2, 3])
def test_proportions_follow_the_weights_within_four_binomial_sigmas(w):
    weights = (0.5, 0.3, 0.2)
    mixture = Mixture.from_weights(SIZES, weights)
    steps = _global_steps(_ranks(mixture, 16, w), epochs=12)
    draws = [_dataset_of(i, mixture) for step in steps for i in step]
    n = len(draws)  # 12 epochs x 253 draws = 3,036
    for d, p in enumerate(weights):
        share = draws.count(d) / n
        sigma = math.sqrt(p * (1 - p) / n)
        assert abs(share - p) < 4 * sigma, (d, share, p, sigma)
    # the small, up-weighted dataset cycles through all its rows; the large one is sampled
    seen = {d: {i for i in set(sum(steps, [])) if _dataset_of(i, mixture) == d} for d in range(3)}
    assert len(seen[2]) == SIZES[2] and len(seen[0]) == SIZES[0]


def test_a_zero_weight_dataset_is_never_drawn():
    mixture = Mixture.from_weights(SIZES, (1, 0, 3))
    steps = _global_steps(_ranks(mixture, 8, 2), epochs=3)
    assert {_dataset_of(i, mixture) for step in steps for i in step} == {0, 2}


@pytest.mark.parametrize("w", [1, 2, 3])
def test_ranks_agree_shards_are_disjoint_and_the_order_is_seeded(w):
    mixture = Mixture.from_weights(SIZES, (0.5, 0.3, 0.2))
    samplers = _ranks(mixture, 12, w)
    steps = list(zip(*[list(s) for s in samplers]))  # each rank's share of the same global batch
    rest = 253 % 12  # N draws per epoch, cut like the concatenation's permutation (plan.py's remainder rule)
    sizes = [len([i for part in step for i in part]) for step in steps]
    assert sizes == ([12] * (253 // 12) + [rest] if rest >= w else [12] * (253 // 12 - 1) + [12 + rest])
    assert all(all(part for part in step) for step in steps)  # every rank gets a sample
    # no row twice in a global batch (each dataset has more rows than its draws in one batch), even
    # where the 13-row dataset starts a new permutation round inside a batch; the last batch, enlarged
    # by a remainder of fewer than W draws, is the documented exception
    whole = [[i for part in step for i in part] for step in steps]
    for flat in whole[:-1] if rest < w else whole:
        assert len(flat) == len(set(flat)), sorted(flat)
    again = _global_steps(_ranks(mixture, 12, w), epochs=2)
    assert again == _global_steps(_ranks(mixture, 12, w), epochs=2)
    assert again != _global_steps(_ranks(mixture, 12, w, seed=1), epochs=2)
    # the draws do not depend on the world size (only their split over ranks, and where the
    # remainder of an epoch goes, do)
    single = _global_steps(_ranks(mixture, 12, 1), epochs=1)
    assert [sorted(s) for s in again[:20]] == [sorted(s) for s in single[:20]]
    assert sorted(sum(again[: len(again) // 2], [])) == sorted(sum(single, []))


@pytest.mark.parametrize("w", [1, 2, 3])
@pytest.mark.parametrize("stop", [1, 7, 15])
def test_resume_gives_the_uninterrupted_sequence(w, stop):
    """Stop after ``stop`` steps of epoch 1, save through JSON, resume in fresh samplers: the
    steps after the resume point equal the uninterrupted run's, on every rank."""
    mixture = Mixture.from_weights(SIZES, (0.6, 0.1, 0.3))
    full = [[] for _ in range(w)]
    for r, s in enumerate(_ranks(mixture, 16, w)):
        for epoch in range(3):
            s.set_epoch(epoch)
            full[r].extend(list(s))
    first = _ranks(mixture, 16, w)
    states = []
    for s in first:
        s.set_epoch(0)
        list(s)
        s.set_epoch(1)
        it = iter(s)
        for _ in range(stop):
            next(it)
        states.append(json.loads(json.dumps(s.state_dict())))
    steps_per_epoch = len(first[0])
    for r, s in enumerate(_ranks(mixture, 16, w)):
        s.load_state_dict(states[r])
        resumed = []
        for epoch in (1, 2):
            s.set_epoch(epoch)
            resumed.extend(list(s))
        assert resumed == full[r][steps_per_epoch + stop:]


def test_resume_refuses_other_weights():
    saved = _ranks(Mixture.from_weights(SIZES, (0.6, 0.1, 0.3)), 16, 1)[0].state_dict()
    other = _ranks(Mixture.from_weights(SIZES, (0.5, 0.2, 0.3)), 16, 1)[0]
    with pytest.raises(ValueError, match="mixture"):
        other.load_state_dict(saved)


@pytest.mark.parametrize("weights, match", [
    ((0.5, 0.5), "2 weights .* for 3 datasets"),
    ((0.5, -0.1, 0.6), "must be finite and >= 0"),
    ((0, 0, 0), "all 0"),
])
def test_bad_weights_are_refused(weights, match):
    with pytest.raises(ValueError, match=match):
        Mixture.from_weights(SIZES, weights)


def test_a_weighted_dataset_without_rows_and_a_size_mismatch_are_refused():
    with pytest.raises(ValueError, match="no rows"):
        Mixture.from_weights((5, 0), (1, 1), names=["a.parquet", "b.parquet"])
    with pytest.raises(ValueError, match="hold 253 rows"):
        BalancedDistributedBatchSampler([1.0] * 250, 8, 1, 0, mixture=Mixture.from_weights(SIZES, (1, 1, 1)))


@pytest.mark.parametrize("w", [1, 2])
def test_no_row_twice_in_a_global_batch_across_permutation_rounds(w):
    """The 13-row dataset drawn 30% of the time starts a new permutation round every ~2.7 global
    batches of 16, mostly inside a batch: the rows that batch already holds wait for the next."""
    mixture = Mixture.from_weights((150, 40, 13), (0.5, 0.2, 0.3))
    steps = _global_steps(_ranks(mixture, 16, w), epochs=4)
    assert len(steps) == 4 * 13  # 203 draws per epoch: 12 batches of 16 and a last one of 11 (>= W)
    for flat in steps:
        assert len(flat) == len(set(flat)), sorted(flat)
    draws = [i for flat in steps for i in flat if i >= 190]
    assert len(set(draws)) == 13 and len(draws) > 4 * 13  # the small dataset cycled, every row drawn

"""One-source global batches (``Mixture(one_source=True)``): every step's samples come from the
source its global batch drew, that source depends only on (seed, epoch, batch), the shares
follow the weights, resume is exact, and mixed plans and states are pinned by hashes, all
simulated for every rank in one process."""

from __future__ import annotations

import hashlib
import json
import math

import numpy as np
import pytest

from raggedvl.sampling import BalancedDistributedBatchSampler, Mixture

SIZES = (20, 30, 5)  # the 5-row source is smaller than the global batch of 8
WEIGHTS = (0.5, 0.2, 0.3)


def _mixture(weights=WEIGHTS, sizes=SIZES):
    return Mixture.from_weights(sizes, weights, names=["a", "b", "c"], one_source=True)


def _ranks(mixture, g, w, seed=0, **kw):
    costs = np.random.default_rng(1).lognormal(0.0, 1.0, mixture.num_samples)
    return [BalancedDistributedBatchSampler(costs, g, w, r, seed=seed, mixture=mixture, **kw) for r in range(w)]


def _epoch(samplers, epoch):
    """[(source name, [every rank's list])] of one epoch's steps."""
    for s in samplers:
        s.set_epoch(epoch)
    per_rank = [list(s) for s in samplers]
    assert len({len(r) for r in per_rank}) == 1  # every rank takes the same number of steps
    sources = [samplers[0].step_source(k) for k in range(len(per_rank[0]))]
    for s in samplers[1:]:  # every rank names the same source for every step
        assert [s.step_source(k) for k in range(len(per_rank[0]))] == sources
    return list(zip(sources, zip(*per_rank)))


@pytest.mark.parametrize("w", [1, 2, 3])
def test_every_sample_of_a_step_comes_from_the_source_it_names(w):
    mixture = _mixture()
    offsets = mixture.offsets()
    for epoch in range(3):
        steps = _epoch(_ranks(mixture, 8, w), epoch)
        # 55 samples, G = 8: 6 full batches and a remainder of 7 >= W, so 7 steps, as a mixed epoch has
        assert len(steps) == 7
        for k, (name, parts) in enumerate(steps):
            d = "abc".index(name)
            flat = [i for part in parts for i in part]
            assert all(part for part in parts)  # every rank gets a sample
            assert all(offsets[d] <= i < offsets[d] + SIZES[d] for i in flat), (k, name, flat)
            assert len(flat) == min(8, SIZES[d]) == len(set(flat))  # a full batch (all 5 rows of c), no repeat
            assert mixture.batch_source(0, epoch, k) == d  # a pure function of (seed, epoch, batch)


def test_the_sources_and_the_batches_do_not_depend_on_the_world_size():
    mixture = _mixture()
    by_w = {}
    for w in (1, 2, 3):
        by_w[w] = [[(name, sorted(i for part in parts for i in part)) for name, parts in _epoch(_ranks(mixture, 8, w), e)]
                   for e in range(3)]
    assert by_w[1] == by_w[2] == by_w[3]
    names = [[name for name, _ in epoch] for epoch in by_w[1]]
    assert len({tuple(n) for n in names}) > 1  # each epoch draws its own sources
    other = [[name for name, _ in _epoch(_ranks(mixture, 8, 1, seed=1), e)] for e in range(3)]
    assert other != names


def test_each_sources_rows_go_round_before_any_repeats():
    """Source b (30 rows) drawn in several batches of 8 in an epoch: its rows come from seeded
    permutation rounds, so no row repeats until all 30 were drawn."""
    mixture = _mixture(weights=(0.0, 1.0, 0.0))
    steps = _epoch(_ranks(mixture, 8, 2), 0)
    assert [name for name, _ in steps] == ["b"] * 7
    batches = [{i for part in parts for i in part} for _, parts in steps]
    assert all(len(b) == 8 for b in batches)  # no row twice in a global batch
    assert len(set().union(*batches[:3])) == 24  # the first round: 24 distinct rows in 3 batches...
    assert set().union(*batches[:4]) == set(range(20, 50))  # ...and its last 6 in the 4th (with 2 of the next)


def test_the_shares_of_the_sources_follow_the_weights_within_four_binomial_sigmas():
    mixture = _mixture()
    names = [name for e in range(60) for name, _ in _epoch(_ranks(mixture, 8, 1), e)]
    n = len(names)  # 60 epochs x 7 batches = 420
    for name, p in zip("abc", WEIGHTS):
        share = names.count(name) / n
        assert abs(share - p) < 4 * math.sqrt(p * (1 - p) / n), (name, share, p)


def test_a_zero_weight_source_is_never_drawn_and_may_have_fewer_rows_than_ranks():
    mixture = Mixture.from_weights((20, 2, 12), (1, 0, 1), names=["a", "b", "c"], one_source=True)
    names = {name for e in range(4) for name, _ in _epoch(_ranks(mixture, 6, 3), e)}
    assert names == {"a", "c"}


@pytest.mark.parametrize("w", [1, 2, 3])
@pytest.mark.parametrize("stop", [1, 4])
def test_resume_gives_the_uninterrupted_steps_and_sources(w, stop):
    mixture = _mixture()
    full = [_epoch(_ranks(mixture, 8, w), e) for e in range(3)]
    first = _ranks(mixture, 8, w)
    states = []
    for s in first:
        s.set_epoch(1)
        it = iter(s)
        for _ in range(stop):
            next(it)
        states.append(json.loads(json.dumps(s.state_dict())))
    assert states[0]["mixture"] == {"sizes": list(SIZES), "weights": list(WEIGHTS), "one_source": True}
    resumed = _ranks(mixture, 8, w)
    for s, state in zip(resumed, states):
        s.load_state_dict(state)
    for s in resumed:
        s.set_epoch(1)
    per_rank = [list(s) for s in resumed]
    assert [(resumed[0].step_source(stop + k), parts) for k, parts in enumerate(zip(*per_rank))] == full[1][stop:]
    assert _epoch(resumed, 2) == full[2]


def test_a_mixed_sampler_refuses_a_one_source_state_and_back():
    mixed = Mixture.from_weights(SIZES, WEIGHTS)
    one = _ranks(_mixture(), 8, 1)[0].state_dict()
    with pytest.raises(ValueError, match="mixture: saved .*'one_source': True"):
        _ranks(mixed, 8, 1)[0].load_state_dict(one)
    with pytest.raises(ValueError, match="mixture"):
        _ranks(_mixture(), 8, 1)[0].load_state_dict(_ranks(mixed, 8, 1)[0].state_dict())


def test_a_patch_cap_split_keeps_each_step_within_its_source():
    mixture = _mixture()
    patches = [300 + 50 * (i % 7) for i in range(mixture.num_samples)]
    capped = _ranks(mixture, 8, 2, max_patches_per_rank=1000, patches=patches)
    plain = _epoch(_ranks(mixture, 8, 2), 0)
    steps = _epoch(capped, 0)
    assert len(steps) > len(plain)  # the cap split some global batches
    offsets = mixture.offsets()
    for name, parts in steps:
        d = "abc".index(name)
        assert all(offsets[d] <= i < offsets[d] + SIZES[d] for part in parts for i in part)
        assert all(sum(patches[i] for i in part) <= 1000 for part in parts)
    merged = [(name, sorted(i for part in parts for i in part)) for name, parts in steps]
    order = []  # consecutive steps of one split batch together hold that batch
    for name, rows in merged:
        if order and order[-1][0] == name and len(order[-1][1]) + len(rows) <= min(8, SIZES["abc".index(name)]):
            order[-1] = (name, sorted(order[-1][1] + rows))
        else:
            order.append((name, rows))
    assert order == [(name, sorted(i for part in parts for i in part)) for name, parts in plain]


def test_sources_spread_over_the_dataset_map_back_to_their_rows():
    """A source column: rows of a source are not contiguous, so the sampler gets ``indices``
    listing source x's rows, then source y's; the yielded lists hold those rows, ascending."""
    labels = np.array([0, 1, 1, 0, 1, 0, 0, 1, 1, 1, 0, 1])  # row -> source
    positions = np.argsort(labels, kind="stable")  # source 0's rows, then source 1's
    sizes = np.bincount(labels).tolist()
    mixture = Mixture.from_weights(sizes, sizes, names=["x", "y"], one_source=True)
    costs = np.linspace(1.0, 2.0, 12)[positions]
    samplers = [BalancedDistributedBatchSampler(costs, 4, 2, r, seed=2, mixture=mixture, indices=positions)
                for r in range(2)]
    for epoch in range(3):
        for name, parts in _epoch(samplers, epoch):
            assert all(part == sorted(part) for part in parts)
            assert {int(labels[i]) for part in parts for i in part} == {"xy".index(name)}


@pytest.mark.parametrize("kwargs, match", [
    ({"world_size": 6}, "source c has 5 rows, fewer than the 6 ranks: .* give it weight 0"),
    ({"homogeneous": True}, "homogeneous steps .* would mix the sources"),
])
def test_settings_one_source_batches_cannot_hold_are_refused(kwargs, match):
    w = kwargs.pop("world_size", 2)
    with pytest.raises(ValueError, match=match):
        BalancedDistributedBatchSampler([1.0] * 55, 8, w, 0, mixture=_mixture(), **kwargs)


# ---------------------------------------------------------------- mixed batches are unchanged

def _digest(samplers, epochs=2):
    out = []
    for s in samplers:
        for e in range(epochs):
            s.set_epoch(e)
            out.append([list(x) for x in s])
        out.append(s.state_dict(step=1))
    return hashlib.sha256(json.dumps(out, sort_keys=True).encode()).hexdigest()[:16]


# sha256 of two epochs' plans and a state of every rank, pinned: the default (mixed) path must
# not move (a change reorders every mixed run and the plans its checkpoints continue)
MIXED_DIGESTS = {
    ("plain", 1): "0fed205a869d4c4c", ("plain", 3): "fa36e74cc373fb2d",
    ("mixture", 1): "df30ead5934a63ab", ("mixture", 3): "48fe31a1fce0d86b",
    ("mixture_rows", 1): "4cb488977fd0aa8a", ("mixture_rows", 3): "b0b731a1dc7054c9",
    ("cap", 1): "01d85bd8661f44ba", ("cap", 3): "fc695b50f608db99",
}


@pytest.mark.parametrize("case, w", sorted(MIXED_DIGESTS))
def test_mixed_plans_and_states_equal_those_before_one_source_batches(case, w):
    costs = np.random.default_rng(5).lognormal(0.0, 1.0, 61).tolist()
    kw, extra = {}, {}
    if case == "mixture":
        kw = {"mixture": Mixture.from_weights((20, 30, 11), (0.5, 0.2, 0.3))}
    elif case == "mixture_rows":
        kw = {"mixture": Mixture.from_weights((18, 30, 10), (0.5, 0.2, 0.3))}
        keep = [i for i in range(61) if i not in (3, 25, 60)]
        costs, extra = [costs[i] for i in keep], {"indices": keep}
    elif case == "cap":
        kw = {"max_patches_per_rank": 900, "patches": [int(100 + 37 * (i % 11)) for i in range(61)]}
    samplers = [BalancedDistributedBatchSampler(costs, 8, w, r, seed=7, **kw, **extra) for r in range(w)]
    assert _digest(samplers) == MIXED_DIGESTS[(case, w)]

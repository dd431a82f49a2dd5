"""Rank simulation in one process: BalancedDistributedBatchSampler for W in {1, 2, 3, 8, 64}."""

from __future__ import annotations

import json

import numpy as np
import pytest

from raggedvl.sampling import BalancedDistributedBatchSampler, estimate_costs


def _costs(n, seed=0):
    return np.random.default_rng(seed).lognormal(0.0, 1.0, n)


def _ranks(costs, g, w, **kw):
    return [BalancedDistributedBatchSampler(costs, g, w, r, **kw) for r in range(w)]


def _epoch(samplers):
    """[S][W] index lists, checking every rank takes the same number of steps."""
    per_rank = [list(s) for s in samplers]
    lengths = {len(steps) for steps in per_rank}
    assert lengths == {len(samplers[0])}
    return [list(step) for step in zip(*per_rank)]


CASES = [  # (W, N, G): includes remainders r >= W, 0 < r < W, r == 0 and N < G
    (1, 50, 8),
    (2, 101, 16),
    (3, 100, 12),
    (3, 25, 40),
    (8, 333, 64),
    (64, 1030, 256),
]


@pytest.mark.parametrize("w,n,g", CASES)
def test_shards_disjoint_complete_equal_steps(w, n, g):
    costs = _costs(n, seed=w)
    steps = _epoch(_ranks(costs, g, w, seed=3))
    flat = [i for step in steps for part in step for i in part]
    assert sorted(flat) == list(range(n))  # every sample exactly once
    for step in steps:
        assert all(len(part) >= 1 for part in step)  # no idle rank
        assert all(part == sorted(part) for part in step)
    sizes = [sum(len(p) for p in step) for step in steps]
    r = n % g
    if n < g:
        assert sizes == [n]
    elif r == 0 or r >= w:
        assert sizes[: n // g] == [g] * (n // g) and sum(sizes) == n
    else:  # remainder smaller than W joins the last full step
        assert sizes == [g] * (n // g - 1) + [g + r]


@pytest.mark.parametrize("w,n,g", [(2, 101, 16), (8, 333, 64)])
def test_drop_last_keeps_full_steps_only(w, n, g):
    steps = _epoch(_ranks(_costs(n), g, w, drop_last=True))
    assert [sum(len(p) for p in s) for s in steps] == [g] * (n // g)
    flat = [i for s in steps for p in s for i in p]
    assert len(set(flat)) == len(flat) == (n // g) * g


@pytest.mark.parametrize("w,n,g", CASES)
def test_deterministic_and_seeded(w, n, g):
    costs = _costs(n)
    a = _epoch(_ranks(costs, g, w, seed=7))
    b = _epoch(_ranks(costs, g, w, seed=7))
    assert a == b
    if n > g:
        assert a != _epoch(_ranks(costs, g, w, seed=8))
        later = _ranks(costs, g, w, seed=7)
        for s in later:
            s.set_epoch(1)
        assert _epoch(later) != a


@pytest.mark.parametrize("w,n,g", CASES)
def test_resume_mid_epoch_continues_identically(w, n, g):
    costs = _costs(n)
    for s in (full := _ranks(costs, g, w, seed=5)):
        s.set_epoch(2)
    reference = _epoch(full)
    cut = len(reference) // 2
    states = []
    for s in _ranks(costs, g, w, seed=5):
        s.set_epoch(2)
        it = iter(s)
        for _ in range(cut):
            next(it)
        states.append(json.loads(json.dumps(s.state_dict())))
    assert all(st == states[0] for st in states)  # the state is rank-independent
    resumed = _ranks(costs, g, w, seed=5)
    for s, st in zip(resumed, states):
        s.load_state_dict(st)
        s.set_epoch(2)  # the training loop's set_epoch must not discard the resume point
    assert _epoch_tail(resumed) == reference[cut:]
    # after the resumed epoch ends, a new iteration replays the epoch from its start
    assert _epoch(resumed) == reference


def _epoch_tail(samplers):
    return [list(step) for step in zip(*[list(s) for s in samplers])]


def test_state_mismatch_is_reported():
    s = BalancedDistributedBatchSampler(_costs(100), 16, 2, 0)
    state = s.state_dict()
    other = BalancedDistributedBatchSampler(_costs(100), 32, 2, 0, seed=1)
    with pytest.raises(ValueError, match="global_batch_size: saved 16, now 32.*seed: saved 0, now 1"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match="costs_sha256"):
        BalancedDistributedBatchSampler(_costs(100, seed=9), 16, 2, 0).load_state_dict(state)


def test_balance_close_to_lower_bound():
    costs = _costs(2000, seed=11)
    steps = BalancedDistributedBatchSampler(costs, 64, 8, 0).plan()
    ratios = []
    for step in steps:
        loads = [costs[p].sum() for p in step]
        bound = max(sum(loads) / len(loads), max(costs[i] for p in step for i in p))
        ratios.append(max(loads) / bound)
    assert np.mean(ratios) <= 1.02


def test_c08_uneven_naive_shards_still_give_equal_steps():
    # C08: 17 samples, 2 ranks, 2 per rank per step: a naive rank-strided shard gives 9 and 8
    # samples, i.e. 5 and 4 batches -> the rank with 4 would wait forever in a collective.
    n, w, per_rank = 17, 2, 2
    naive = [len(range(r, n, w)) for r in range(w)]
    assert [-(-k // per_rank) for k in naive] == [5, 4]
    samplers = _ranks(_costs(n), per_rank * w, w)
    steps = _epoch(samplers)
    assert len(samplers[0]) == len(samplers[1]) == len(steps) == 4
    assert sorted(i for s in steps for p in s for i in p) == list(range(n))


def _c10_dataset(copies):
    """Per copy: one 4-megapixel two-page spread and seven thumbnails (max_pixels uncapped)."""
    from raggedvl.images import ImagePolicy

    sizes = ([(2400, 1700)] + [(160, 120)] * 7) * copies
    return estimate_costs(sizes, 16, policy=ImagePolicy(max_pixels=16 * 1024 * 1024))


def test_c10_spread_isolated_on_its_rank_and_patch_cap_holds():
    est = _c10_dataset(1)
    spread = int(np.argmax(est.costs))
    assert est.patches[spread] > 20 * est.patches.min()
    (step,) = BalancedDistributedBatchSampler(est.costs, 8, 2, 0).plan()
    loads = [est.costs[p].sum() for p in step]
    bound = max(sum(loads) / 2, est.costs.max())
    assert max(loads) == pytest.approx(bound, rel=1e-12)  # the spread rank carries nothing else
    # equal-count sharding (4 + 4) puts the spread with three thumbnails
    equal = max(est.costs[:4].sum(), est.costs[4:].sum())
    assert equal > max(loads)
    # a per-rank patch budget equal to the spread's patches is never exceeded
    cap = int(est.patches[spread])
    (capped,) = BalancedDistributedBatchSampler(est.costs, 8, 2, 0, max_patches_per_rank=cap, patches=est.patches).plan()
    assert max(est.patches[p].sum() for p in capped) <= cap
    with pytest.raises(ValueError, match=f"sample {spread} has {cap} patches > max_patches_per_rank {cap - 1}"):
        BalancedDistributedBatchSampler(est.costs, 8, 2, 0, max_patches_per_rank=cap - 1, patches=est.patches)


def test_c10_cap_splits_steps_that_cannot_fit_and_keeps_coverage():
    est = _c10_dataset(6)  # 6 spreads among 48 samples: some global batches of 8 hold 3+ spreads
    cap = int(est.patches.max() * 1.2)  # at most one spread per rank
    samplers = _ranks(est.costs, 8, 2, max_patches_per_rank=cap, patches=est.patches, seed=1)
    steps = _epoch(samplers)
    assert len(steps) > 48 // 8  # some global batch was split into more steps
    for step in steps:
        assert all(est.patches[p].sum() <= cap for p in step) and all(step)
    assert sorted(i for s in steps for p in s for i in p) == list(range(48))


def test_homogeneous_steps_group_similar_costs_and_cover():
    costs = _costs(1024, seed=4)
    mixed = BalancedDistributedBatchSampler(costs, 64, 8, 0).plan()
    homo_sampler = BalancedDistributedBatchSampler(costs, 64, 8, 0, homogeneous=True, bucket_steps=16)
    homo = homo_sampler.plan()
    assert sorted(i for s in homo for p in s for i in p) == list(range(1024))

    def spread(steps):  # mean within-step coefficient of variation of costs
        return np.mean([np.std(c) / np.mean(c) for c in (costs[[i for p in s for i in p]] for s in steps)])

    assert spread(homo) < 0.5 * spread(mixed)
    assert homo != BalancedDistributedBatchSampler(costs, 64, 8, 0, homogeneous=True, bucket_steps=16, seed=1).plan()


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(global_batch_size=1, world_size=2, rank=0), "global_batch_size 1 < world_size 2"),
        (dict(global_batch_size=4, world_size=2, rank=2), r"rank 2 is not in \[0, 2\)"),
        (dict(global_batch_size=64, world_size=2, rank=0, drop_last=True), "leaves no step"),
        (dict(global_batch_size=4, world_size=2, rank=0, max_patches_per_rank=10), "needs patches="),
    ],
)
def test_bad_arguments_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BalancedDistributedBatchSampler(_costs(10), **kwargs)


def test_bad_cost_names_the_sample():
    costs = _costs(10)
    costs[6] = -1.0
    with pytest.raises(ValueError, match="sample 6 has cost -1.0"):
        BalancedDistributedBatchSampler(costs, 4, 2, 0)
    with pytest.raises(ValueError, match="only 1 samples for 2 ranks"):
        BalancedDistributedBatchSampler([1.0], 4, 2, 0)


def test_cap_that_no_split_can_meet_raises_before_training():
    # 3 samples of 9 patches on 2 ranks of 10 patches: one step cannot hold all 3, and a split
    # into steps of fewer than W = 2 samples would leave a rank idle.
    sampler = BalancedDistributedBatchSampler([1.0, 1.0, 1.0], 3, 2, 0, max_patches_per_rank=10, patches=[9, 9, 9])
    with pytest.raises(ValueError, match="cannot be packed under 2 ranks x 10 patches"):
        len(sampler)


def test_state_dict_with_consumed_step_override_and_cap_round_trip():
    est = _c10_dataset(4)
    kw = dict(max_patches_per_rank=int(est.patches.max() * 1.5), patches=est.patches, seed=2)
    a = BalancedDistributedBatchSampler(est.costs, 8, 2, 1, **kw)
    steps = list(a)
    state = json.loads(json.dumps(a.state_dict(step=1)))  # a DataLoader prefetched ahead
    b = BalancedDistributedBatchSampler(est.costs, 8, 2, 1, **kw)
    b.load_state_dict(state)
    assert list(b) == steps[1:]
    with pytest.raises(ValueError, match="outside epoch 0"):
        b.load_state_dict({**state, "step": len(steps) + 1})


@pytest.mark.parametrize("w", [1, 3])
def test_indices_map_the_plan_to_the_kept_rows_and_enter_the_fingerprint(w):
    """Rows left out (here 2, 5 and 9 of 0..11) are never drawn: the plan over the 9 kept rows is
    the plain plan over 9 samples, mapped through ``indices``; a resume must keep the same rows."""
    kept = [0, 1, 3, 4, 6, 7, 8, 10, 11]
    costs = _costs(len(kept))
    plain = _epoch(_ranks(costs, 3, w))
    mapped = _epoch(_ranks(costs, 3, w, indices=kept))
    assert mapped == [[[kept[i] for i in part] for part in step] for step in plain]
    assert sorted(i for step in mapped for part in step for i in part) == kept  # every kept row once, full steps
    assert all(sum(len(part) for part in step) == 3 for step in mapped)
    state = _ranks(costs, 3, w, indices=kept)[0].state_dict()
    assert state["num_samples"] == 9 and state["rows_sha256"] is not None
    assert _ranks(costs, 3, w)[0].state_dict()["rows_sha256"] is None  # older states (no key) still load
    with pytest.raises(ValueError, match="rows_sha256"):
        _ranks(costs, 3, w, indices=[0, 1, 2, 4, 6, 7, 8, 10, 11])[0].load_state_dict(state)
    for bad in ([0, 1], [1, 1, 2, 3, 4, 5, 6, 7, 8], [-1, 0, 1, 2, 3, 4, 5, 6, 7]):  # any order, but distinct
        with pytest.raises(ValueError, match="indices"):
            BalancedDistributedBatchSampler(costs, 3, w, 0, indices=bad)


def test_a_state_of_another_world_size_continues_with_the_same_global_batches():
    """Saved by 2 ranks after 3 steps, loaded by 4 (and 1): the rest of the epoch trains the
    global batches the 2-rank run had left, each partitioned over the new ranks."""
    costs = _costs(100, seed=3)
    saved = BalancedDistributedBatchSampler(costs, 16, 2, 0)
    saved.set_epoch(1)
    state = saved.state_dict(step=3)
    remaining = [sorted(i for part in step for i in part) for step in saved.plan()[3:]]
    for world in (4, 1):
        resumed = _ranks(costs, 16, world)
        for s in resumed:
            s.load_state_dict(state)
        assert resumed[0].state_dict()["step"] == 3 and resumed[0].epoch == 1
        steps = [sorted(i for part in step for i in part) for step in _epoch_tail(resumed)]
        assert steps == remaining


def test_a_position_inside_a_step_of_the_new_plan_is_refused():
    """A patch cap splits a global batch into 2 steps for 2 ranks but not for 4: the 2-rank
    position after the first half has no 4-rank equivalent."""
    from raggedvl.sampling import SamplerPositionError

    costs, patches = [1.0] * 8, [5.0] * 8
    two = BalancedDistributedBatchSampler(costs, 8, 2, 0, max_patches_per_rank=10.0, patches=patches)
    assert len(two.plan()) == 2  # 8 samples x 5 patches over 2 ranks x 10: two steps of 4 samples
    four = BalancedDistributedBatchSampler(costs, 8, 4, 0, max_patches_per_rank=10.0, patches=patches)
    assert len(four.plan()) == 1
    with pytest.raises(SamplerPositionError, match="step 1 of epoch 0 with 2 ranks ends inside a step of the plan "
                                                   "for 4 ranks.*resume with 2 processes"):
        four.load_state_dict(two.state_dict(step=1))
    four.load_state_dict(two.state_dict(step=2))  # the end of the global batch: the end of the epoch
    assert four.state_dict()["step"] == 1

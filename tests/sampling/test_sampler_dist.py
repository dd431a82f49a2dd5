"""Real processes: each rank plans on its own (no communication) and the shards still fit."""

from __future__ import annotations

import numpy as np
import pytest

from tests.dist.harness import run_distributed

pytestmark = pytest.mark.dist

N, G = 203, 16  # remainder 11 >= W: a last, smaller step


def _costs():
    return np.random.default_rng(42).lognormal(0.0, 1.2, N)


MIX_SIZES, MIX_WEIGHTS = (150, 40, 13), (0.5, 0.2, 0.3)  # three datasets in the N rows, mixed by weight


def _sampler(rank, world_size, mixed):
    from raggedvl.sampling import BalancedDistributedBatchSampler, Mixture

    mixture = Mixture.from_weights(MIX_SIZES, MIX_WEIGHTS) if mixed else None
    return BalancedDistributedBatchSampler(_costs(), G, world_size, rank, seed=9, homogeneous=not mixed, mixture=mixture)


def _rank_epochs(rank, world_size):
    out = {}
    for mixed in (False, True):
        sampler = _sampler(rank, world_size, mixed)
        epochs = []
        for epoch in (0, 1):
            sampler.set_epoch(epoch)
            epochs.append([list(step) for step in sampler])
        out[mixed] = epochs
    return out


def test_independent_processes_agree_on_the_plan():
    from raggedvl.sampling import BalancedDistributedBatchSampler

    world = 2
    results = run_distributed(_rank_epochs, world)
    per_rank = [r[False] for r in results]
    for epoch in (0, 1):
        steps = [per_rank[r][epoch] for r in range(world)]
        assert len(steps[0]) == len(steps[1]) == -(-N // G)  # same step count on every rank
        flat = [i for rank_steps in steps for step in rank_steps for i in step]
        assert sorted(flat) == list(range(N))  # disjoint and complete across real processes
        assert all(step for rank_steps in steps for step in rank_steps)
        # identical to the single-process simulation of each rank
        for r in range(world):
            ref = BalancedDistributedBatchSampler(_costs(), G, world, r, seed=9, homogeneous=True)
            ref.set_epoch(epoch)
            assert steps[r] == [list(s) for s in ref]
    # weighted mixing of three datasets: every process computes the same draws; the ranks' shares
    # of each global batch are disjoint, non-empty and equal the one-process simulation of each rank
    for epoch in (0, 1):
        steps = [results[r][True][epoch] for r in range(world)]
        assert len(steps[0]) == len(steps[1])
        for step in zip(*steps):
            assert all(step) and not set(step[0]) & set(step[1])
        for r in range(world):
            ref = _sampler(r, world, mixed=True)
            ref.set_epoch(epoch)
            assert steps[r] == [list(s) for s in ref]

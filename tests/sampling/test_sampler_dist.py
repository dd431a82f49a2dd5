"""Real processes: each rank plans on its own (no communication) and the shards still fit."""

from __future__ import annotations

import numpy as np
import pytest

from tests.dist.harness import run_distributed

pytestmark = pytest.mark.dist

N, G = 203, 16  # remainder 11 >= W: a last, smaller step


def _costs():
    return np.random.default_rng(42).lognormal(0.0, 1.2, N)


def _rank_epochs(rank, world_size):
    from raggedvl.sampling import BalancedDistributedBatchSampler

    sampler = BalancedDistributedBatchSampler(_costs(), G, world_size, rank, seed=9, homogeneous=True)
    epochs = []
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        epochs.append([list(step) for step in sampler])
    return epochs


def test_independent_processes_agree_on_the_plan():
    from raggedvl.sampling import BalancedDistributedBatchSampler

    world = 2
    per_rank = run_distributed(_rank_epochs, world)
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

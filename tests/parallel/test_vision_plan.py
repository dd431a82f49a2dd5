"""Encoder rebalancing plan (pure; ranks simulated in one process): coverage, balance, determinism."""

from __future__ import annotations

import itertools
import random

import pytest

from raggedvl.parallel.vision_plan import plan_vision_balance


def _loads(costs, assignment, world):
    loads = [0.0] * world
    for r, row in enumerate(costs):
        for i, c in enumerate(row):
            loads[assignment[r][i]] += c
    return loads


def test_one_large_image_keeps_its_rank_and_the_small_ones_move():
    costs = [[100.0, 5.0, 3.0, 2.0], [1.0]]
    plan = plan_vision_balance(costs)
    assert plan.assignment == ((0, 1, 1, 1), (1,))
    assert plan.loads_before == (110.0, 1.0) and plan.loads_after == (100.0, 11.0)
    assert plan.moved == 3
    assert plan.max_over_mean_before == pytest.approx(110 * 2 / 111)
    assert plan.computed_by(1) == [(0, 1), (0, 2), (0, 3), (1, 0)]
    assert plan.sent_by(0) == [0, 1, 2, 3]


def test_balanced_ranks_and_a_single_rank_move_nothing():
    assert plan_vision_balance([[4.0, 4.0], [5.0, 3.0]]).moved == 0
    assert plan_vision_balance([[9.0, 1.0]]).moved == 0
    assert plan_vision_balance([[], []]).moved == 0
    # within the tolerance nothing moves; beyond it the plan acts
    assert plan_vision_balance([[6.0, 1.0], [4.0]], tolerance=0.25).moved == 0
    assert plan_vision_balance([[6.0, 1.0], [4.0]]).moved == 1


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_random_plans_cover_every_image_once_and_never_raise_the_maximum(world):
    rng = random.Random(world)
    for _ in range(200):
        costs = [[rng.choice([0.5, 1, 2, 4, 50, 400]) for _ in range(rng.randint(0, 5))] for _ in range(world)]
        plan = plan_vision_balance(costs)
        assert [len(row) for row in plan.assignment] == [len(row) for row in costs]
        assert all(0 <= c < world for row in plan.assignment for c in row)
        assert list(plan.loads_after) == pytest.approx(_loads(costs, plan.assignment, world))
        assert max(plan.loads_after) <= max(plan.loads_before) + 1e-9
        computed = sorted(itertools.chain.from_iterable(plan.computed_by(r) for r in range(world)))
        assert computed == sorted((r, i) for r, row in enumerate(costs) for i in range(len(row)))
        total = sum(map(sum, costs))
        if total:  # LPT's bound over the cap max(mean, largest image): at most cap + the largest pool image
            cap = max(total / world, max(c for row in costs for c in row))
            assert max(plan.loads_after) <= 2 * cap + 1e-9
        assert plan_vision_balance(costs) == plan  # deterministic: every rank computes the same plan


def test_bad_costs_raise_naming_the_rank_and_image():
    with pytest.raises(ValueError, match="rank 1's image costs .* image 0 has -1.0"):
        plan_vision_balance([[1.0], [-1.0]])
    with pytest.raises(ValueError, match="at least one rank"):
        plan_vision_balance([])
    with pytest.raises(ValueError, match="tolerance"):
        plan_vision_balance([[1.0]], tolerance=-0.1)

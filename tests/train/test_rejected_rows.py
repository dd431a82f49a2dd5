"""Pairs the size estimate rejected under on_bad_image="skip" are left out of the sampler's plan
(every step holds G readable pairs, the epoch counts the kept pairs), also when datasets are
mixed by weight; the start line counts what is drawn and names what is not (rejected pairs, a
weight-0 dataset). No data or processor: the size estimate is given."""

import numpy as np
import pytest

from raggedvl.parallel import DistInfo
from raggedvl.sampling import SampleCosts
from raggedvl.app.config import TrainConfig
from raggedvl.app.setup import make_sampler, training_pairs_text

import torch


def _costs(n, rejected=()):
    costs = np.linspace(1.0, 2.0, n)
    return SampleCosts(costs=costs, patches=np.full(n, 4, dtype=np.int64), seq_lens=np.full(n, 40, dtype=np.int64),
                       features=np.zeros((n, 4)), skipped=[{"sample": i, "name": f"row {i}", "reason": "bad"} for i in rejected])


def _info(rank=0, world=1):
    return DistInfo(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"), backend="none")


def _drawn(sampler, epochs=1):
    steps = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        steps += [list(ix) for ix in sampler]
    return steps


def test_rejected_rows_are_never_drawn_and_steps_stay_full():
    cfg = TrainConfig(dataset="a.parquet", global_batch_size=4)
    costs = _costs(9, rejected=[5])
    sampler = make_sampler(cfg, costs, _info())
    steps = _drawn(sampler, epochs=3)
    assert len(sampler) == 2 and [len(s) for s in steps] == [4] * 6  # 8 kept pairs: 2 full steps per epoch
    assert all(5 not in s for s in steps)
    assert sorted(i for s in steps[:2] for i in s) == [0, 1, 2, 3, 4, 6, 7, 8]
    assert training_pairs_text(cfg, costs) == "8 training pairs (1 more left out: image unreadable)"
    # every rank builds the same plan: two ranks' shards partition each step
    ranks = [_drawn(make_sampler(cfg, costs, _info(r, 2))) for r in range(2)]
    assert [sorted(a + b) for a, b in zip(*ranks)] == [sorted(s) for s in steps[:2]]
    # nothing rejected: the sampler is the one older runs built (same resume fingerprint)
    assert make_sampler(cfg, _costs(8), _info()).state_dict()["rows_sha256"] is None


def test_mixing_counts_each_datasets_kept_rows():
    cfg = TrainConfig(dataset=["a.parquet", "b.parquet"], dataset_weights=[1, 1], global_batch_size=4)
    costs = _costs(10, rejected=[1, 2, 7])  # a: rows 0-5 (1, 2 rejected), b: rows 6-9 (7 rejected)
    sampler = make_sampler(cfg, costs, _info(), dataset_sizes=[6, 4])
    assert sampler.mixture.sizes == (4, 3)
    steps = _drawn(sampler, epochs=4)
    assert len(sampler) == 2 and [len(s) for s in steps] == [4, 3] * 4  # 7 draws an epoch: a step of 4, then of 3
    drawn = {i for s in steps for i in s}
    assert drawn <= {0, 3, 4, 5, 6, 8, 9} and {0, 6} <= drawn


def test_a_zero_weight_dataset_is_named_on_the_start_line():
    cfg = TrainConfig(dataset=["a.parquet", "b.parquet"], dataset_weights=[1, 0], global_batch_size=4)
    costs = _costs(56)
    assert training_pairs_text(cfg, costs, [40, 16]) == "56 training pairs (b.parquet: 16 of them at weight 0, never drawn)"
    steps = _drawn(make_sampler(cfg, costs, _info(), dataset_sizes=[40, 16]))
    assert max(i for s in steps for i in s) < 40
    costs = _costs(56, rejected=[0, 50])
    assert training_pairs_text(cfg, costs, [40, 16]) == (
        "54 training pairs (b.parquet: 15 of them at weight 0, never drawn; 2 more left out: image unreadable)")


def test_a_weighted_dataset_whose_pairs_were_all_rejected_is_named():
    cfg = TrainConfig(dataset=["a.parquet", "b.parquet"], dataset_weights=[1, 1], global_batch_size=4)
    with pytest.raises(ValueError, match=r"b.parquet has weight 1 but the size estimate rejected all its 2 pairs .*weight 0"):
        make_sampler(cfg, _costs(8, rejected=[6, 7]), _info(), dataset_sizes=[6, 2])
    cfg = TrainConfig(dataset=["a.parquet", "b.parquet"], dataset_weights=[1, 0], global_batch_size=4)
    assert make_sampler(cfg, _costs(8, rejected=[6, 7]), _info(), dataset_sizes=[6, 2]).mixture.sizes == (6, 0)

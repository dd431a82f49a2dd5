"""Tier 2: ``real_sample_count`` against the samples accelerate really repeats, every process of
W in {2, 3, 4} simulated in one process (accelerate's own ``DataLoaderShard``, ``BatchSamplerShard``
and ``IterableDatasetShard``, built the way ``prepare_data_loader`` builds them).

The truth: in the epoch's global order (steps, then processes in rank order) a sample is real
the first time it appears; every later appearance is a repeat that completes the last batch.
The dispatcher (``DataLoaderDispatcher``, which needs a process group) is covered on real gloo
processes in ``tests/dist/test_hf_repeats.py``.
"""

import itertools

import pytest
import torch
from accelerate.data_loader import BatchSamplerShard, DataLoaderShard, IterableDatasetShard
from torch.utils.data import BatchSampler, IterableDataset, SequentialSampler

from raggedvl.parallel.repeats import check_repeats_identifiable, real_sample_count


class Stream(IterableDataset):
    def __init__(self, n: int, sized: bool = True) -> None:
        self.n, self.sized = n, sized

    def __iter__(self):
        return iter(range(self.n))

    def __len__(self):
        if not self.sized:
            raise TypeError("a stream has no length")
        return self.n


def _map_loader(n, b, world, rank, split=False, drop_last=False):
    batch_size = b * world if split else b
    sampler = BatchSampler(SequentialSampler(range(n)), batch_size, drop_last)
    shard = BatchSamplerShard(sampler, num_processes=world, process_index=rank, split_batches=split)
    return DataLoaderShard(list(range(n)), batch_sampler=shard, collate_fn=torch.tensor)


def _stream_loader(n, b, world, rank, split=False, sized=True):
    shard = IterableDatasetShard(Stream(n, sized), batch_size=b * world if split else b, num_processes=world,
                                 process_index=rank, split_batches=split)
    return DataLoaderShard(shard, batch_size=b, collate_fn=torch.tensor)


def _run(make, n, b, world, **kw):
    """Per process: the batches (sample indices) and the predicted real count of each."""
    out = []
    for rank in range(world):
        loader = make(n, b, world, rank, **kw)
        check_repeats_identifiable(loader, world)
        out.append([(batch.tolist(), real_sample_count(loader, len(batch), rank=rank, world_size=world))
                    for batch in loader])
    return out


def _check_against_truth(per_rank, n):
    steps = len(per_rank[0])
    assert all(len(r) == steps for r in per_rank), "accelerate gives every process the same number of batches"
    seen, real_total = set(), 0
    for step in range(steps):
        for rank_batches in per_rank:
            batch, predicted = rank_batches[step]
            truth = []
            for i in batch:
                truth.append(i not in seen)
                seen.add(i)
            assert truth == [True] * predicted + [False] * (len(batch) - predicted), (step, batch, predicted)
            real_total += predicted
    assert real_total == n and seen == set(range(n))


@pytest.mark.parametrize("world,b", [(2, 2), (3, 2), (4, 3)])
@pytest.mark.parametrize("n", [1, 5, 7, 12, 13])
@pytest.mark.parametrize("kind", ["map", "map-split", "stream", "stream-split"])
def test_real_counts_match_the_repeats_accelerate_makes(kind, n, world, b):
    make = _map_loader if kind.startswith("map") else _stream_loader
    _check_against_truth(_run(make, n, b, world, split=kind.endswith("split")), n)


def test_the_issue_case_map_style_last_step_is_4_0_1_2():
    per_rank = _run(_map_loader, 5, 2, 2)
    assert [per_rank[0][-1], per_rank[1][-1]] == [([4, 0], 1), ([1, 2], 0)]


def test_drop_last_and_single_process_count_everything():
    for rank in range(2):
        loader = _map_loader(5, 2, 2, rank, drop_last=True)
        assert [real_sample_count(loader, len(x), rank=rank, world_size=2) for x in loader] == [2]
    plain = torch.utils.data.DataLoader(list(range(5)), batch_size=2)
    assert [real_sample_count(plain, len(x), rank=0, world_size=2) for x in plain] == [2, 2, 1]


def test_a_stream_without_length_read_by_every_process_is_refused_up_front():
    loader = _stream_loader(5, 2, 2, 0, sized=False)
    with pytest.raises(ValueError, match="no __len__.*dispatch_batches"):
        check_repeats_identifiable(loader, 2)
    check_repeats_identifiable(loader, 1)  # one process: nothing is repeated
    batches = list(itertools.islice(iter(_stream_loader(8, 2, 2, 0, sized=False)), 2))
    assert len(batches) == 2

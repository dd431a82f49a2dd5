"""Collating in DataLoader worker processes (`--data-workers`, raggedvl.app.batches): the
batches, the sampler positions a checkpoint saves, and the losses of a run are those of the
run that collates on the training thread."""

import json

import pytest
import torch

from raggedvl.sampling import BalancedDistributedBatchSampler
from raggedvl.app.batches import StepIndices, default_workers, step_batches
from raggedvl.app.config import TrainConfig
from raggedvl.app.loop import train
from tests.conftest import SMALL_DEV_PAIRS, SMALL_TRAIN_PAIRS


class _Items(torch.utils.data.Dataset):
    def __len__(self):
        return 10

    def __getitem__(self, i):
        return {"i": i}


def _collate(examples):
    return [e["i"] for e in examples]


def _sampler(rank=0):
    return BalancedDistributedBatchSampler([float(1 + i % 3) for i in range(10)], global_batch_size=4, world_size=2,
                                           rank=rank, seed=3)


def _stream(workers, start=None, rank=0):
    sampler = _sampler(rank)
    if start is not None:
        sampler.load_state_dict(start)
    indices = StepIndices(sampler, sampler.epoch)
    return sampler, indices, step_batches(_Items(), _collate, indices, workers=workers, pin_memory=False)


@pytest.mark.parametrize("workers", [0, 2])
def test_batches_and_claimed_positions_follow_the_sampler_across_epochs(workers):
    sampler, indices, stream = _stream(workers)
    steps = len(sampler)  # 3 steps per epoch (10 samples, global batch 4, remainder kept)
    expected = []
    for epoch in range(3):
        sampler.set_epoch(epoch)
        expected += [(list(ix), (epoch, s + 1)) for s, ix in enumerate(sampler.plan()[k][0] for k in range(steps))]
    got = []
    for _ in range(len(expected)):
        batch = next(stream)
        got.append((batch, indices.positions.popleft()))  # the trainer claims one position per batch
    assert got == expected
    assert steps == 3


def test_a_stream_started_at_a_claimed_position_continues_exactly():
    """What resume does: the sampler state saved at the position claimed with batch k (the
    workers have drawn further) restarts the stream at batch k + 1, also across an epoch end."""
    sampler, indices, stream = _stream(workers=2)
    seen, claimed = [], []
    for _ in range(9):
        seen.append(next(stream))
        claimed.append(indices.positions.popleft())
    for k in range(1, 8):
        epoch, step = claimed[k - 1]
        state = {**_sampler().state_dict(step=step), "epoch": epoch}  # as Checkpointer.save writes it
        _, _, resumed = _stream(workers=2, start=state)
        assert [next(resumed) for _ in range(2)] == seen[k:k + 2], k


def test_negative_workers_is_refused():
    with pytest.raises(ValueError, match="workers must be >= 0"):
        step_batches(_Items(), _collate, StepIndices(_sampler(), 0), workers=-1, pin_memory=False)


def _run(tmp_path, cache, workers: int) -> list[float]:
    """A 5-step run (4 steps per epoch: it crosses an epoch) with a checkpoint every 2 steps."""
    out = tmp_path / f"run-{workers}"
    cfg = TrainConfig(max_steps=5, global_batch_size=4, eval_before=False, eval_after=False, checkpoint_every=2,
                      max_train_samples=SMALL_TRAIN_PAIRS, max_eval_samples=SMALL_DEV_PAIRS, data_workers=workers,
                      output_dir=str(out), data_cache=str(cache))
    train(cfg)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if r.get("event") == "train"], out


@pytest.mark.slow
def test_two_workers_train_the_losses_of_collating_in_process(tmp_path, small_data_cache):
    in_process, out0 = _run(tmp_path, small_data_cache, 0)
    workers, out2 = _run(tmp_path, small_data_cache, 2)
    assert len(in_process) == 5 and max(in_process) - min(in_process) > 1e-3  # the run moves
    assert workers == in_process  # bit-identical: same batches, same RNG stream
    positions = {}
    for name in ("step-000004", "step-000005"):  # the checkpoint's sampler position is the trained batch's
        saved = [json.loads((o / "checkpoints" / name / "trainer_state.json").read_text())["sampler"] for o in (out0, out2)]
        assert saved[0] == saved[1]
        positions[name] = (saved[1]["epoch"], saved[1]["step"])
    # step 4 ends epoch 0 and step 5 is epoch 1's first, though the workers had drawn further
    assert positions == {"step-000004": (0, 4), "step-000005": (1, 1)}


@pytest.mark.parametrize("cuda, ranks, threads, cores, expected", [
    (True, 8, 1, 8, 1),  # the GPU computes: a core collates
    (False, 1, 1, 2, 1),  # one rank, one thread, a spare core
    (False, 2, 1, 2, 0),  # two ranks fill two cores
    (False, 1, 2, 2, 0),  # the rank's threads fill the cores
    (False, 8, 1, 16, 1),
    (False, 8, 1, 15, 0),
])
def test_a_worker_is_started_by_default_only_where_it_has_a_core_of_its_own(cuda, ranks, threads, cores, expected):
    assert default_workers(cuda=cuda, ranks_on_node=ranks, threads_per_rank=threads, cores=cores) == expected


def test_default_workers_refuses_counts_below_one():
    with pytest.raises(ValueError, match="got 0, 1, 2"):
        default_workers(cuda=False, ranks_on_node=0, threads_per_rank=1, cores=2)

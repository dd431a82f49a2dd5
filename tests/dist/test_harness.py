import pytest
import torch

from tests.dist.harness import run_distributed

pytestmark = pytest.mark.dist


def _allreduce_rank(rank, world_size):
    import torch.distributed as dist

    t = torch.tensor([float(rank + 1)], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item()


def _raise_on_rank1(rank, world_size):
    if rank == 1:
        raise ValueError("boom on rank 1")
    return rank


def test_harness_runs_collectives():
    assert run_distributed(_allreduce_rank, 2) == [3.0, 3.0]


def test_harness_reports_failing_rank():
    with pytest.raises(RuntimeError, match="rank 1 raised"):
        run_distributed(_raise_on_rank1, 2, timeout=30)

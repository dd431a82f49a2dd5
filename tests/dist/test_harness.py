"""The multi-process test harness: results, failures, and its two bounds (start-up is not
counted in the run timeout; a real hang and a rank that never starts are still caught)."""

import time

import pytest
import torch

from tests.dist.harness import run_distributed
from tests.dist.slow_start import allreduce_rank

pytestmark = pytest.mark.dist


def _raise_on_rank1(rank, world_size):
    if rank == 1:
        raise ValueError("boom on rank 1")
    return rank


def _rank1_never_joins(rank, world_size):
    import torch.distributed as dist

    if rank == 1:
        time.sleep(3600)  # stuck outside the collective rank 0 waits in
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def test_harness_runs_collectives():
    assert run_distributed(allreduce_rank, 2) == [3.0, 3.0]


def test_harness_reports_failing_rank():
    with pytest.raises(RuntimeError, match="rank 1 raised"):
        run_distributed(_raise_on_rank1, 2, timeout=30)


def test_slow_start_up_is_not_counted_in_the_run_timeout(monkeypatch):
    """Each rank's start-up takes 6 s more (as on a loaded machine) while the run timeout is
    4 s: the run bound starts at the rendezvous, so the run passes."""
    monkeypatch.setenv("RAGGEDVL_TEST_SLOW_IMPORT_S", "6")
    start = time.monotonic()
    assert run_distributed(allreduce_rank, 2, timeout=4) == [3.0, 3.0]
    assert time.monotonic() - start > 6  # the start-up really was longer than the run bound


def test_a_hang_after_the_rendezvous_is_caught_and_named():
    """Rank 1 never joins; rank 0 waits in the all-reduce (its gloo timeout is the same 5 s, so
    it is either still waiting or has just raised when the bound expires)."""
    start = time.monotonic()
    pattern = r"ranks \[(0, )?1\] returned nothing within \d+ s after the rendezvous \(timeout 5 s x slowdown"
    with pytest.raises(RuntimeError, match=pattern):
        run_distributed(_rank1_never_joins, 2, timeout=5)
    assert time.monotonic() - start < 400  # start-up, 5 s x at most 10, the kill: not the 3600 s sleep


def test_a_rank_that_never_starts_is_caught_and_named(monkeypatch):
    monkeypatch.setenv("RAGGEDVL_TEST_SLOW_IMPORT_S", "3600")
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"ranks \[0, 1\] did not start \(interpreter, imports\) within startup_timeout=3 s"):
        run_distributed(allreduce_rank, 2, startup_timeout=3)
    assert time.monotonic() - start < 30

"""A 2-rank run frees its DDP wrapper (whose reducer holds the process group) before it destroys
the process group, so the group's last reference is dropped by ``destroy_process_group`` and not
by a later garbage collection in a thread holding the GIL that gloo's threads wait for (a rank
that hung after its summary: ``raggedvl.app.loop.release_wrapped_model``)."""

from __future__ import annotations

import weakref

import pytest

from raggedvl.app.config import TrainConfig
from tests.dist.harness import run_distributed

pytestmark = pytest.mark.slow  # two gloo ranks, two steps of the tiny model


def _train_watching_teardown(rank, world_size, run_dir, cache):
    from raggedvl.app import loop

    wrapped, alive_at_shutdown = [], []
    run, shutdown = loop.Trainer.run, loop.shutdown

    def watched_run(self):
        wrapped.append((type(self.model).__name__, weakref.ref(self.model)))
        return run(self)

    def watched_shutdown():
        alive_at_shutdown.append(wrapped[0][1]() is not None)
        shutdown()

    loop.Trainer.run, loop.shutdown = watched_run, watched_shutdown
    summary = loop.train(TrainConfig(max_steps=2, max_train_samples=8, global_batch_size=4, eval_before=False,
                                     eval_after=False, output_dir=str(run_dir), data_cache=str(cache)))
    return {"wrapper": wrapped[0][0], "alive_at_shutdown": alive_at_shutdown, "summary": bool(summary) or rank > 0}


def test_the_ddp_wrapper_is_freed_before_the_process_group_is_destroyed(small_data_cache, tmp_path):
    results = run_distributed(_train_watching_teardown, 2, tmp_path / "run", small_data_cache)
    assert results == [{"wrapper": "DistributedDataParallel", "alive_at_shutdown": [False], "summary": True}] * 2

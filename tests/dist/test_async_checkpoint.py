"""``--async-checkpoint`` on 2 gloo processes (FSDP2, the real training loop): the shards are
copied to host memory and written by a background thread while training continues.

- The checkpoints equal those of synchronous saves (same weights, bit for bit: the copy is
  taken at the save's step, before the next optimizer step changes the parameters), and a
  resume from one gives the uninterrupted run's losses.
- At most one save is in flight: when a save starts, the previous one is complete (renamed into
  place).
- A background write that fails on one rank (a full disk) stops the run on every rank at the
  next save with ``CheckpointError`` naming the failed save's step; nothing of it is left.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.dist.harness import run_distributed
from tests.dist.test_fsdp2_trainer import write_synthetic_manifest

pytestmark = [pytest.mark.dist, pytest.mark.slow]


def _config(out: str, name: str, data: str, cache: str, **extra):
    from raggedvl.app.config import TrainConfig

    return TrainConfig(output_dir=f"{out}/{name}", dataset=data, data_cache=cache, max_train_samples=None,
                       max_eval_samples=None, max_pixels=50_176, global_batch_size=4, max_steps=4, warmup_steps=1,
                       lr=5e-5, checkpoint_every=2, eval_before=False, eval_after=False, log_every=1,
                       strategy="fsdp2", **extra)


def _losses(run: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r.get("event") == "train"}


def _runs(rank: int, world_size: int, data: str, cache: str, out: str) -> dict:
    import errno

    from torch.distributed.checkpoint import filesystem

    import raggedvl.app.checkpointer as checkpointer
    from raggedvl.app.checkpoint import CheckpointError, checkpoint_weights
    from raggedvl.app.loop import Trainer
    from raggedvl.parallel import barrier
    from raggedvl.parallel.runtime import init_distributed

    info = init_distributed()  # reuses the harness's gloo group
    result: dict = {}
    started = []  # at each save's start: the checkpoints complete so far
    real_start = checkpointer.start_checkpoint

    def recording_start(root, step, contents, **kwargs):
        started.append((step, sorted(p.name for p in Path(root).glob("step-*") if ".tmp-" not in p.name)))
        return real_start(root, step, contents, **kwargs)

    checkpointer.start_checkpoint = recording_start
    Trainer(_config(out, "sync", data, cache), info).run()
    started.clear()
    Trainer(_config(out, "async", data, cache, async_checkpoint=True), info).run()
    result["started"] = list(started)
    checkpointer.start_checkpoint = real_start
    if rank == 0:
        shutil.copytree(Path(out, "async"), Path(out, "resumed"))
        shutil.rmtree(Path(out, "resumed", "checkpoints", "step-000004"))
    barrier()
    Trainer(_config(out, "resumed", data, cache, async_checkpoint=True, resume=True), info).run()

    real_write = filesystem._FileSystemWriter.write_data

    def full_disk_on_rank_1(self, plan, planner):  # inside DCP's write: DCP reports it to every rank
        if rank == 1 and "step-000002" in str(self.path):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(self, plan, planner)

    filesystem._FileSystemWriter.write_data = full_disk_on_rank_1
    try:
        Trainer(_config(out, "failed", data, cache, async_checkpoint=True), info).run()
        result["error"] = None
    except CheckpointError as exc:
        result["error"] = str(exc)
    finally:
        filesystem._FileSystemWriter.write_data = real_write
    barrier()
    if rank == 0:
        result["losses"] = {name: _losses(Path(out, name)) for name in ("sync", "async", "resumed")}
        for name in ("sync", "async"):
            result[f"{name}/folders"] = sorted(p.name for p in Path(out, name, "checkpoints").iterdir())
        result["same_weights"] = all(
            a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
            for a, b in ((checkpoint_weights(Path(out, "sync", "checkpoints", s)),
                          checkpoint_weights(Path(out, "async", "checkpoints", s)))
                         for s in ("step-000002", "step-000004")))
        result["failed/folders"] = sorted(p.name for p in Path(out, "failed", "checkpoints").iterdir())
    return result


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("async")
    data = str(write_synthetic_manifest(root / "data", n_train=16, n_dev=3))
    return run_distributed(_runs, 2, data, str(root / "cache"), str(root / "runs"), timeout=900)


def test_background_checkpoints_equal_synchronous_ones_and_resume_exactly(runs):
    r0 = runs[0]
    assert r0["sync/folders"] == r0["async/folders"] == ["step-000002", "step-000004"]  # no temporary left
    assert r0["same_weights"]
    assert r0["losses"]["async"] == r0["losses"]["sync"]  # saving in the background changes no step
    assert sorted(r0["losses"]["resumed"]) == [1, 2, 3, 4]
    # the same weights, optimizer state, samples and partition: the same float operations
    assert r0["losses"]["resumed"] == pytest.approx(r0["losses"]["async"], rel=1e-6, abs=1e-7)


def test_at_most_one_background_save_is_in_flight(runs):
    for r in runs:  # the step-4 save starts after the step-2 one is in place
        assert r["started"] == [(2, []), (4, ["step-000002"])]


def test_a_failed_background_save_stops_every_rank_naming_its_step(runs):
    for r in runs:
        assert r["error"] is not None
        assert r["error"].startswith("the background checkpoint of step 2 failed: writing the checkpoint of step 2")
        assert "no space left on the device" in r["error"]
    assert runs[0]["failed/folders"] == []  # nothing of it kept, no temporary folder left

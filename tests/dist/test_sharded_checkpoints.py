"""Sharded checkpoints (torch.distributed.checkpoint) through the real training loop on gloo.

- Same number of processes: a run resumed from its step-2 checkpoint logs the uninterrupted
  run's losses (DDP, FSDP2, FSDP2 + GradCache on 2 processes; LoRA: test_interop_resume.py).
- Another number of processes: a 2-process run resumed on 1 process, and a 1-process run resumed
  on 2, continue the same global batches (the sampler draws the global batch, then partitions
  it) with the uninterrupted run's losses within float32 rounding (tolerances at the asserts).
- No rank materialises the full state during a save: every tensor the save path creates on a
  rank is at most the size of that rank's largest shard, and all of them together at most its
  own shards' bytes, while the largest full parameter is larger than that (the same probe sees
  it when the state is gathered).
- ``raggedvl export`` of a sharded checkpoint (one process, no process group) writes the same
  weights as the export of the same weights saved whole, and ``--model`` builds them.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from tests.dist.harness import run_distributed
from tests.dist.test_fsdp2_trainer import write_synthetic_manifest

pytestmark = [pytest.mark.dist, pytest.mark.slow]

RUNS = {"ddp": dict(strategy="ddp"), "fsdp2": dict(strategy="fsdp2"),
        "fsdp2_grad_cache": dict(strategy="fsdp2", grad_cache=True, grad_cache_budget=96)}


def _config(out: str, name: str, data: str, cache: str, **extra):
    from raggedvl.app.config import TrainConfig

    return TrainConfig(output_dir=f"{out}/{name}", dataset=data, data_cache=cache, max_train_samples=None,
                       max_eval_samples=None, max_pixels=50_176, global_batch_size=4, max_steps=4, warmup_steps=1, lr=5e-5,
                       checkpoint_every=2, eval_before=False, eval_after=False, log_every=1, **extra)


def _losses(run: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r.get("event") == "train"}


def _copy_to_step(run: Path, copy: Path, step: int) -> None:
    """``copy``: ``run`` as it was right after its checkpoint ``step`` (newer ones removed)."""
    shutil.copytree(run, copy)
    for ckpt in (copy / "checkpoints").iterdir():
        if int(ckpt.name.split("-")[1]) > step:
            shutil.rmtree(ckpt)


class _CreatedTensors:
    """Bytes of every tensor an aten op creates while active (a DTensor: its local part); views
    share their base's storage and create nothing."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        probe = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                import torch
                from torch.utils._pytree import tree_leaves

                out = func(*args, **(kwargs or {}))
                if not (func._schema.is_mutable or torch.Tag.view_copy in func.tags or func.is_view):
                    for t in tree_leaves(out):
                        if isinstance(t, torch.Tensor):
                            local = getattr(t, "_local_tensor", t)
                            probe.sizes.append(local.numel() * local.element_size())
                return out

        self.sizes: list[int] = []
        self.mode = Mode()


def _local_bytes(t) -> int:
    local = getattr(t, "_local_tensor", t)
    return local.numel() * local.element_size()


def _same_world(rank: int, world_size: int, data: str, cache: str, out: str) -> dict:
    """Each strategy: 4 steps straight, then resumed from a copy of its step-2 checkpoint; the
    FSDP2 run's trainer also saves once more under the tensor probe and writes its weights whole."""
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict

    from raggedvl.app.loop import Trainer
    from raggedvl.parallel import barrier, unwrap_model
    from raggedvl.parallel.runtime import init_distributed

    info = init_distributed()  # reuses the harness's gloo group
    result: dict = {}
    for name, extra in RUNS.items():
        trainer = Trainer(_config(out, name, data, cache, **extra), info)
        trainer.run()
        if rank == 0:
            _copy_to_step(Path(out, name), Path(out, f"{name}-resumed"), step=2)
        barrier()
        Trainer(_config(out, f"{name}-resumed", data, cache, resume=True, **extra), info).run()
        if rank == 0:
            result[name] = {"straight": _losses(Path(out, name)), "resumed": _losses(Path(out, f"{name}-resumed"))}
        if name != "fsdp2":
            continue
        model, optimizer = trainer.model, trainer.optimizer
        own = [_local_bytes(t) for t in model.parameters()]
        own += [_local_bytes(t) for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
        probe = _CreatedTensors()
        with probe.mode:
            trainer.checkpoints.save(trainer.training_state(), Path(out, "probed"))
        gather = _CreatedTensors()
        with gather.mode:  # the same probe around a full (gathered) state dict
            get_state_dict(unwrap_model(model), optimizer, options=StateDictOptions(full_state_dict=True))
        result[f"memory/{rank}"] = {"created_max": max(probe.sizes), "created_sum": sum(probe.sizes),
                                    "own_max": max(own), "own_sum": sum(own), "gather_max": max(gather.sizes),
                                    "full_max": max(p.numel() * p.element_size() for p in model.parameters())}
        full = get_model_state_dict(unwrap_model(model), options=StateDictOptions(full_state_dict=True,
                                                                                  cpu_offload=True))
        if rank == 0:  # the same weights, saved whole: a saved retriever folder
            unwrap_model(model).save_pretrained(Path(out, "whole"), state_dict=full)
            trainer.c.processor.save_pretrained(Path(out, "whole"))
        barrier()
    return result


def _straight(rank: int, world_size: int, data: str, cache: str, out: str, name: str) -> dict:
    from raggedvl.app.loop import Trainer
    from raggedvl.parallel.runtime import init_distributed

    Trainer(_config(out, name, data, cache, strategy="ddp"), init_distributed()).run()
    return _losses(Path(out, name)) if rank == 0 else {}


def _resumed(rank: int, world_size: int, data: str, cache: str, out: str, names: list[str]) -> dict:
    """Resume each of ``names`` (copies of runs of another number of processes) here."""
    from raggedvl.app.loop import Trainer
    from raggedvl.parallel.runtime import init_distributed

    info = init_distributed()
    result = {}
    for name in names:
        strategy = "fsdp2" if name.startswith("fsdp2") else "ddp"
        Trainer(_config(out, name, data, cache, strategy=strategy, resume=True), info).run()
        result[name] = _losses(Path(out, name)) if rank == 0 else {}
    return result


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sharded")
    data = str(write_synthetic_manifest(root / "data", n_train=16, n_dev=3))
    cache, out = str(root / "cache"), str(root / "runs")
    same = run_distributed(_same_world, 2, data, cache, out, timeout=900)
    for name in ("ddp", "fsdp2"):  # 2 -> 1
        _copy_to_step(Path(out, name), Path(out, f"{name}-on-1"), step=2)
    to_one = run_distributed(_resumed, 1, data, cache, out, ["ddp-on-1", "fsdp2-on-1"], timeout=600)[0]
    one = run_distributed(_straight, 1, data, cache, out, "single", timeout=600)[0]
    _copy_to_step(Path(out, "single"), Path(out, "single-on-2"), step=2)  # 1 -> 2
    to_two = run_distributed(_resumed, 2, data, cache, out, ["single-on-2"], timeout=600)[0]
    return {"same": same, "to_one": to_one, "one": one, "to_two": to_two, "out": Path(out)}


@pytest.mark.parametrize("name", list(RUNS))
def test_resume_on_the_same_processes_gives_the_uninterrupted_losses(runs, name):
    r = runs["same"][0][name]
    assert sorted(r["straight"]) == sorted(r["resumed"]) == [1, 2, 3, 4]
    # training moved the loss, and not to the chance value ln 4 of a collapsed model
    assert len(set(r["straight"].values())) == 4 and abs(r["straight"][4] - math.log(4)) > 1e-3
    # the same weights, optimizer state, samples and partition: the same float operations
    assert r["resumed"] == pytest.approx(r["straight"], rel=1e-6, abs=1e-7)


def test_resume_on_another_number_of_processes_continues_the_same_batches(runs):
    """Step 3 (the first after the resume) runs the same weights on the same global batch, only
    partitioned over another number of ranks: the per-rank loss shares and the gradient
    all-reduce add the same float32 terms in another order, a few ulp of the loss (rel 1e-5).
    Step 4 starts from weights one AdamW update apart by that rounding; AdamW divides each
    gradient element by its running RMS, so elements with near-zero gradients move by up to
    about lr either way, a loss change far below 1e-3 relative for this tiny model (the
    tolerance test_fsdp2_trainer.py gives DDP against FSDP2), while a wrong sample or a lost
    optimizer state moves it by more than 1e-2."""
    straight2 = runs["same"][0]
    for name in ("ddp", "fsdp2"):  # 2 -> 1
        ref, got = straight2[name]["straight"], runs["to_one"][f"{name}-on-1"]
        assert sorted(got) == [1, 2, 3, 4]  # steps 1-2 from the 2-process run, 3-4 on one process
        assert got[3] == pytest.approx(ref[3], rel=1e-5) and got[4] == pytest.approx(ref[4], rel=1e-3), (name, got, ref)
    ref, got = runs["one"], runs["to_two"]["single-on-2"]  # 1 -> 2
    assert sorted(got) == [1, 2, 3, 4]
    assert got[3] == pytest.approx(ref[3], rel=1e-5) and got[4] == pytest.approx(ref[4], rel=1e-3), (got, ref)
    assert abs(ref[4] - ref[2]) > 1e-2 * abs(ref[2])  # the tolerance is far below what training moves


def test_the_resume_records_both_process_counts(runs):
    records = [json.loads(line) for line in (runs["out"] / "ddp-on-1" / "metrics.jsonl").read_text().splitlines()]
    assert [r for r in records if r.get("event") == "resume"] == [
        {"event": "resume", "step": 2, "world_size": 1, "checkpoint_world_size": 2}]
    state = json.loads((runs["out"] / "ddp-on-1" / "checkpoints" / "step-000004" / "trainer_state.json").read_text())
    assert state["world_size"] == 1


def test_no_rank_materialises_the_full_state_during_a_save(runs):
    for rank in (0, 1):
        m = runs["same"][rank][f"memory/{rank}"]
        assert m["full_max"] > m["own_max"]  # the largest parameter is sharded: a full one would show
        assert m["gather_max"] >= m["full_max"]  # the probe sees a gathered tensor
        assert m["created_max"] <= m["own_max"], m  # no tensor larger than this rank's largest shard
        assert m["created_sum"] <= m["own_sum"], m  # at most one copy of this rank's own state


def test_export_of_a_sharded_checkpoint_equals_export_of_the_whole_weights(runs, tmp_path):
    from safetensors.torch import load_file

    from raggedvl.app.cli import main

    sharded = runs["out"] / "probed" / "step-000004"
    assert sorted(p.name for p in (sharded / "model").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    for fmt in ("colpali", "transformers"):
        for name, source in (("sharded", sharded), ("whole", runs["out"] / "whole")):
            assert main(["export", str(source), "--format", fmt, "--output", str(tmp_path / fmt / name)]) == 0
        files = sorted(p.name for p in (tmp_path / fmt / "sharded").glob("*.safetensors"))
        assert files == sorted(p.name for p in (tmp_path / fmt / "whole").glob("*.safetensors")) and files
        for file in files:
            got, want = load_file(tmp_path / fmt / "sharded" / file), load_file(tmp_path / fmt / "whole" / file)
            assert got.keys() == want.keys()
            assert all(got[k].dtype == want[k].dtype and got[k].equal(want[k]) for k in want)


def test_a_sharded_checkpoint_is_a_model_to_continue_training_from(runs):
    """``--model step_dir``: the retriever built for training holds the checkpoint's weights,
    consolidated in this process from the 2 ranks' shards."""
    from safetensors.torch import load_file

    from raggedvl.app.config import TrainConfig
    from raggedvl.app.setup import build_cfg_processor, build_model, check_model_checkpoint

    cfg = TrainConfig(model=str(runs["out"] / "probed" / "step-000004"), lora=False, max_pixels=50_176)
    check_model_checkpoint(cfg)  # the launcher's check: the manifest verifies
    state = build_model(cfg, build_cfg_processor(cfg)).state_dict()
    whole = load_file(runs["out"] / "whole" / "raggedvl_retriever.safetensors")
    assert state.keys() == whole.keys() and all(state[k].equal(whole[k]) for k in whole)

"""FSDP2 (``fully_shard``) through the real training loop on 2 gloo processes, against DDP.

FSDP2 runs on CPU with gloo in torch >= 2.6 (all-gather / reduce-scatter of the sharded
parameters go through gloo's ``all_gather_into_tensor`` / ``reduce_scatter_tensor``), so CI can
prove that ``raggedvl train --strategy fsdp2`` gives the same run as ``--strategy ddp``:
one launch trains the tiny retriever for 3 optimizer steps with DDP, FSDP2 and FSDP2 +
GradCache (``Trainer.run``: cost-balanced sampler with unequal per-rank sample counts, exact
cross-rank late-interaction loss, gradient clipping, AdamW, evaluation after training, final
checkpoint), and the test compares the logged global losses, the retrieval metrics and the
checkpointed weights (sharded on disk, consolidated in one process). float32: the
strategies reduce gradients in a different order (all-reduce vs reduce-scatter), so equality
is up to float32 rounding, not bitwise.

The data are a synthetic rdocs-style manifest (pages of varied sizes drawn with PIL), so the
test does not render the R manuals.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from raggedvl.app.config import TrainConfig
from tests.dist.harness import run_distributed

pytestmark = pytest.mark.dist

STEPS = 3
RUNS = {"ddp": ("ddp", False), "fsdp2": ("fsdp2", False), "fsdp2_grad_cache": ("fsdp2", True)}


def write_synthetic_manifest(root: Path, n_train: int, n_dev: int, seed: int = 0) -> Path:
    """An rdocs-style directory: ``manifest.jsonl`` + PNG pages of varied sizes (split train/dev)."""
    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    (root / "images").mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n_train + n_dev):
        w, h = rng.choice([(112, 168), (224, 140), (280, 280), (168, 336)])
        img = Image.new("RGB", (w, h), "white")
        draw = ImageDraw.Draw(img)
        for _ in range(6):
            x, y = rng.randrange(w - 20), rng.randrange(h - 10)
            draw.rectangle([x, y, x + rng.randrange(8, 20), y + rng.randrange(4, 10)],
                           fill=tuple(rng.randrange(256) for _ in range(3)))
        name = f"images/page{i:03d}.png"
        img.save(root / name)
        rows.append({"id": f"page{i:03d}", "image": name, "query": f"section {i} about topic {rng.randrange(1000)}",
                     "split": "train" if i < n_train else "dev", "width": w, "height": h})
    (root / "manifest.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def _train_all(rank: int, world_size: int, data: str, cache: str, out: str) -> dict:
    from raggedvl.app.checkpoint import checkpoint_weights, load_latest_checkpoint
    from raggedvl.app.config import TrainConfig
    from raggedvl.app.loop import Trainer
    from raggedvl.parallel.runtime import init_distributed

    info = init_distributed()  # reuses the harness's gloo group
    result: dict = {"backend": info.backend}
    weights: dict = {}
    initial: dict = {}
    for name, (strategy, grad_cache) in RUNS.items():
        cfg = TrainConfig(
            dataset=data, max_train_samples=None, max_eval_samples=None, max_pixels=50_176, global_batch_size=5,
            max_steps=STEPS, warmup_steps=1, checkpoint_every=100, eval_before=True, eval_after=True,
            eval_train_samples=15, eval_batch_size=4,
            strategy=strategy, grad_cache=grad_cache, grad_cache_budget=96, output_dir=f"{out}/{name}",
            data_cache=cache,
        )
        trainer = Trainer(cfg, info)
        result[f"{name}/wrapped"] = type(trainer.model).__name__
        if name == "ddp":
            initial = {k: v.detach().clone() for k, v in trainer.model.module.state_dict().items()}
        summary = trainer.run()  # includes the evaluation after training (every rank encodes its share)
        if rank == 0:
            result[f"{name}/after"] = {k: v for k, v in summary["rows"].items() if "training" in k}
            records = [json.loads(line) for line in Path(cfg.output_dir, "metrics.jsonl").read_text().splitlines()]
            result[f"{name}/losses"] = [r["loss"] for r in records if r.get("event") == "train"]
            result[f"{name}/rank_samples"] = [r["rank_samples"] for r in records if r.get("event") == "train"]
            ckpt, problems = load_latest_checkpoint(Path(cfg.output_dir) / "checkpoints")
            weights[name] = checkpoint_weights(ckpt.path)  # consolidated from both ranks' shards
            result[f"{name}/ckpt_problems"] = problems
    if rank == 0:  # compare here: tensors do not travel back through the harness's queue
        ref = weights["ddp"]
        for name in ("fsdp2", "fsdp2_grad_cache"):
            got = weights[name]
            result[f"{name}/keys_match"] = got.keys() == ref.keys()
            result[f"{name}/shapes_match"] = all(got[k].shape == ref[k].shape for k in ref)
            result[f"{name}/max_abs_diff"] = max(float((got[k] - ref[k]).abs().max()) for k in ref)
            diff = sum(float((got[k] - ref[k]).double().pow(2).sum()) for k in ref) ** 0.5
            moved = sum(float((ref[k] - initial[k]).double().pow(2).sum()) for k in ref) ** 0.5
            result[f"{name}/diff_over_update"] = diff / moved
        result["ddp/max_abs_update"] = max(float((ref[k] - initial[k]).abs().max()) for k in ref)
    return result


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp2")
    data = write_synthetic_manifest(root / "data", n_train=15, n_dev=3)
    return run_distributed(_train_all, 2, str(data), str(root / "cache"), str(root / "runs"), timeout=400)


def test_fsdp2_wraps_the_model_in_place_and_ddp_wraps_it(runs):
    for r in runs:
        assert r["backend"] == "gloo"
        assert r["ddp/wrapped"] == "DistributedDataParallel"
        # fully_shard swaps the class for an FSDP subclass of the retriever
        assert r["fsdp2/wrapped"].startswith("FSDP") and "Retriever" in r["fsdp2/wrapped"]


def test_fsdp2_run_logs_the_same_losses_as_ddp(runs):
    r0 = runs[0]
    ref = r0["ddp/losses"]
    assert len(ref) == STEPS and len(set(ref)) == STEPS  # training moved the loss
    assert any(a != b for a, b in r0["ddp/rank_samples"])  # unequal per-rank counts were exercised
    for name in ("fsdp2", "fsdp2_grad_cache"):
        assert r0[f"{name}/rank_samples"] == r0["ddp/rank_samples"]
        got = r0[f"{name}/losses"]
        # step 1 starts from the same weights: one forward's float32 rounding in another order
        assert got[0] == pytest.approx(ref[0], rel=1e-5), (name, got, ref)
        # later steps start from weights that differ by the updates' rounding, each element by at
        # most 2 lr per step (AdamW's update is at most about lr per element, checkpoint test below):
        # far below a loss move, 1e-2 here, and far below what a strategy defect changes
        assert got[1:] == pytest.approx(ref[1:], rel=1e-3), (name, got, ref)


def test_fsdp2_evaluation_matches_ddp(runs):
    """The evaluation path under FSDP2 (with and without GradCache) gives DDP's metrics on the same
    weights: before training every run holds the same initial weights, so every metric must agree.
    After 3 steps the weights agree only to AdamW's noise (< 1e-4, next test: AdamW divides by
    the running RMS of near-zero gradients), and this near-collapsed tiny model (mean pairwise
    document cosine ~0.987) ranks on score gaps of that size, so there the ranking metrics may
    differ; the counts and the embedding geometry may not."""
    r0 = runs[0]
    ref = r0["ddp/after"]
    assert sorted(ref) == ["dev: after training", "dev: before training", "train: after training", "train: before training"]
    assert ref["dev: after training"]["queries"] == 3 and ref["train: after training"]["queries"] == 15
    for name in ("fsdp2", "fsdp2_grad_cache"):
        got = r0[f"{name}/after"]
        for split in ("dev: before training", "train: before training"):
            assert got[split] == pytest.approx(ref[split], abs=1e-6), (name, split, got[split], ref[split])
        for split in ("dev: after training", "train: after training"):
            for key in ("queries", "documents", "skipped_documents"):
                assert got[split][key] == ref[split][key], (name, split, key)
            assert got[split]["doc_mean_cosine"] == pytest.approx(ref[split]["doc_mean_cosine"], abs=1e-3)


def test_fsdp2_checkpoint_holds_the_same_full_weights_as_ddp(runs):
    r0 = runs[0]
    assert r0["ddp/ckpt_problems"] == []
    assert r0["ddp/max_abs_update"] > 1e-3  # 3 AdamW steps at the head's lr 2e-3 moved the weights
    for name in ("fsdp2", "fsdp2_grad_cache"):
        assert r0[f"{name}/ckpt_problems"] == []
        assert r0[f"{name}/keys_match"] and r0[f"{name}/shapes_match"]  # full tensors, not shards
        # AdamW divides each update by the gradient's running RMS, so float32 summation-order noise
        # in a near-zero gradient can flip an element's update: at most 2 lr per step and element
        # (the largest lr is the head's, TrainConfig's default 2e-3), whatever the CPU. The whole weight vector still agrees: a strategy defect (a
        # missing reduction, a shard applied twice) moves it by the order of the update itself.
        assert r0[f"{name}/max_abs_diff"] <= 2 * TrainConfig().head_lr * STEPS, (name, r0[f"{name}/max_abs_diff"])
        assert r0[f"{name}/diff_over_update"] < 1e-2, (name, r0[f"{name}/diff_over_update"])


# ------------------------------------------------------------------ GPU variants (gpu_check runs these)
def _cli_train(tmp_path: Path, name: str, nproc: int, *flags: str) -> tuple[list[float], str]:
    """``raggedvl train`` as a user starts it (it launches torchrun itself); per-step losses + stdout."""
    import os
    import sys

    from tests.jobs import TRAIN_READY, run_job

    data = tmp_path / "data"
    if not (data / "manifest.jsonl").is_file():
        write_synthetic_manifest(data, n_train=15, n_dev=3)
    out = tmp_path / name
    cmd = [sys.executable, "-m", "raggedvl.app.cli", "train", "--nproc-per-node", str(nproc), "--dataset", str(data),
           "--max-train-samples", "none", "--max-eval-samples", "none", "--max-pixels", "50176",
           "--global-batch-size", "5", "--max-steps", str(STEPS), "--warmup-steps", "1", "--checkpoint-every", "100",
           "--eval-before", "false", "--eval-after", "false", "--output-dir", str(out),
           "--data-cache", str(tmp_path / "cache"), *flags]
    done = run_job(cmd, ready=TRAIN_READY, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if r.get("event") == "train"], done.stdout + done.stderr


def _cuda_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.gpu
@pytest.mark.skipif(_cuda_count() < 1, reason="needs CUDA: raggedvl train on one GPU with bf16 autocast")
def test_train_on_one_gpu_picks_cuda_and_bf16_tracks_fp32(tmp_path):
    fp32, log32 = _cli_train(tmp_path, "fp32", 1, "--precision", "fp32")
    bf16, _ = _cli_train(tmp_path, "bf16", 1, "--precision", "bf16")
    assert "world size 1 (single process, cuda)" in log32  # a 1-rank job: no process group, the GPU, set automatically
    assert len(fp32) == len(bf16) == STEPS
    assert bf16[0] == pytest.approx(fp32[0], rel=2e-2)  # same weights: bf16 rounding of one forward
    assert bf16 == pytest.approx(fp32, rel=1e-1)  # later steps also carry the rounding of the updates
    assert bf16 != fp32  # autocast was on


@pytest.mark.gpu
@pytest.mark.skipif(_cuda_count() < 2, reason="needs 2 GPUs: NCCL between processes (NCCL refuses 2 ranks on 1 GPU)")
def test_fsdp2_matches_ddp_with_nccl_on_two_gpus(tmp_path):
    ddp, log = _cli_train(tmp_path, "ddp", 2, "--precision", "fp32", "--strategy", "ddp")
    fsdp2, _ = _cli_train(tmp_path, "fsdp2", 2, "--precision", "fp32", "--strategy", "fsdp2")
    assert "world size 2 (nccl, cuda)" in log  # NCCL chosen automatically on GPUs
    assert fsdp2 == pytest.approx(ddp, rel=5e-4, abs=1e-5)  # fp32; CUDA kernels are not bitwise deterministic

"""Checkpoints at Qwen2-VL-2B's width: a full-state gather on rank 0 vs the sharded checkpoints
``raggedvl train`` writes (``torch.distributed.checkpoint``), per rank.

    OMP_NUM_THREADS=1 python benchmarks/checkpoint_scale.py [--world 2] [--text-layers 2] [--vision-depth 4]

The model is raggedvl's retriever on a Qwen2-VL backbone with Qwen2-VL-2B's published
dimensions (decoder width 1,536, MLP 8,960, 12 query / 2 key-value heads of 128, vocabulary
151,936; vision width 1,280, 16 heads, MLP ratio 4, patch 14, 2 x 2 merge), random weights,
with fewer decoder layers and vision blocks so that several CPU processes fit in this machine's
memory (the bytes per parameter, and so the formulas below, do not depend on the depth). For
each of full fine-tuning and LoRA (r 32 on the decoder), with FSDP2 on ``--world`` gloo
processes (float32 weights, AdamW state after one step), per rank:

- ``full gather``: ``get_state_dict(full_state_dict=True, cpu_offload=True)`` of the model and
  the optimizer, then rank 0 writes it with ``torch.save`` (what a full-state checkpoint does);
- ``sharded``: ``raggedvl.app.checkpoint.save_checkpoint`` of the rank's own shards (DCP);
  resume: each rank reads its shards back (``read_sharded`` + ``set_state_dict``).

Measured: wall seconds of the save and of the resume, the peak extra anonymous host memory of
each rank during the save (``/proc/self/status`` RssAnon sampled every 10 ms, minus its value
before), and the bytes written. Extrapolation (printed): a full fine-tune holds 12 bytes per
parameter (float32 weights and AdamW's two moments); a full gather materialises all of it on
rank 0 (12 P bytes of host memory, one writer), a sharded save 12 P / W per rank (W writers in
parallel), so at a disk bandwidth B per writer the save takes 12 P / B vs 12 P / (W B).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PARAMS_2B, PARAMS_7B = 2.21e9, 8.29e9  # Qwen2-VL-2B / 7B parameter counts (published)


class PeakAnon(threading.Thread):
    """Peak RssAnon (MiB) of this process while running."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak, self.stop = 0, threading.Event()

    @staticmethod
    def now() -> int:
        with open("/proc/self/status", encoding="ascii") as f:
            return next(int(line.split()[1]) // 1024 for line in f if line.startswith("RssAnon"))

    def run(self) -> None:
        while not self.stop.is_set():
            self.peak = max(self.peak, self.now())
            self.stop.wait(0.01)


def build(text_layers: int, vision_depth: int, lora: bool):
    from transformers import Qwen2VLConfig

    from raggedvl.families import family_of
    from raggedvl.models import LoraSettings, Retriever, RetrieverConfig

    config = Qwen2VLConfig(
        text_config={"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": text_layers,
                     "num_attention_heads": 12, "num_key_value_heads": 2, "vocab_size": 151936,
                     "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}},
        vision_config={"depth": vision_depth, "embed_dim": 1280, "hidden_size": 1536, "num_heads": 16, "mlp_ratio": 4,
                       "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "in_channels": 3},
    )
    torch.manual_seed(0)
    backbone = family_of(config).model_class._from_config(config)
    settings = RetrieverConfig(lora=LoraSettings(r=32, alpha=32) if lora else None,
                               base="Qwen/Qwen2-VL-2B-Instruct" if lora else None)
    return Retriever(backbone, settings)


def worker(rank: int, world: int, store: str, out: str, args, queue) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    from raggedvl.app.checkpoint import CheckpointContents, save_checkpoint
    from raggedvl.parallel import sharded_state_dicts, unwrap_model, wrap_model
    from raggedvl.parallel.sharded_state import read_sharded
    from raggedvl.parallel.wrap import load_sharded_state_dicts

    rows = []
    for lora in (False, True):
        model = wrap_model(build(args.text_layers, args.vision_depth, lora), strategy="fsdp2", device=torch.device("cpu"))
        params = sum(p.numel() for p in model.parameters())  # a sharded parameter's numel is the whole's
        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trainable, lr=1e-4)
        for p in trainable:
            p.grad = torch.zeros_like(p)
        optimizer.step()  # AdamW's moments exist, as after a step
        for method in ("full gather", "sharded"):
            folder = Path(out) / f"{'lora' if lora else 'full'}-{method.replace(' ', '-')}"
            dist.barrier()
            base, peak = PeakAnon.now(), PeakAnon()
            peak.start()
            t0 = time.perf_counter()
            if method == "full gather":
                model_sd, optim_sd = get_state_dict(model, optimizer,
                                                    options=StateDictOptions(full_state_dict=True, cpu_offload=True))
                model_sd = unwrap_model(model).weights_to_save(model_sd)  # LoRA: the base was gathered, then dropped
                if rank == 0:
                    folder.mkdir(parents=True, exist_ok=True)
                    torch.save({"model": model_sd, "optimizer": optim_sd}, folder / "state.pt")
                del model_sd, optim_sd
                dist.barrier()
            else:
                model_sd, optim_sd = sharded_state_dicts(model, optimizer)
                model_sd = unwrap_model(model).weights_to_save(model_sd)  # LoRA: adapters and head only
                save_checkpoint(folder, 1, CheckpointContents(model_state=model_sd, optimizer_state=optim_sd,
                                                              rng_states=[{}] * world, trainer_state={"step": 1}))
                del model_sd, optim_sd
            save_s = time.perf_counter() - t0
            peak.stop.set()
            peak.join()
            resume_s = float("nan")
            if method == "sharded":
                step = next(folder.glob("step-*"))
                dist.barrier()
                t0 = time.perf_counter()
                model_sd, optim_sd = sharded_state_dicts(model, optimizer)
                model_sd = unwrap_model(model).weights_to_save(model_sd)
                read_sharded(step / "model", model_sd)
                read_sharded(step / "optimizer", optim_sd)
                load_sharded_state_dicts(model, optimizer, model_sd, optim_sd)
                resume_s = time.perf_counter() - t0
            dist.barrier()
            written = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) if rank == 0 else 0
            rows.append({"rank": rank, "tuning": "LoRA" if lora else "full", "method": method,
                         "params": params, "save_s": save_s, "resume_s": resume_s,
                         "peak_extra_mib": max(0, peak.peak - base), "bytes": written})
            dist.barrier()
            if rank == 0:
                shutil.rmtree(folder, ignore_errors=True)
        del model, optimizer
    queue.put(rows)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--text-layers", type=int, default=2)
    parser.add_argument("--vision-depth", type=int, default=4)
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args()
    out = args.dir or Path(tempfile.mkdtemp(prefix="raggedvl-ckpt-"))
    store = tempfile.mktemp(prefix="raggedvl-store-")
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=worker, args=(r, args.world, store, str(out), args, queue)) for r in range(args.world)]
    for p in procs:
        p.start()
    rows = [r for _ in procs for r in queue.get()]
    for p in procs:
        p.join()
    load = os.getloadavg()[0]
    print(f"Qwen2-VL-2B width, {args.text_layers} decoder layers, {args.vision_depth} vision blocks, FSDP2 on "
          f"{args.world} gloo processes, float32, load average {load:.1f}")
    print("| tuning | method | parameters | rank | save s | resume s | peak extra host MiB | bytes written (rank 0 sees all) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in sorted(rows, key=lambda r: (r["tuning"], r["method"], r["rank"])):
        print(f"| {r['tuning']} | {r['method']} | {r['params']:,} | {r['rank']} | {r['save_s']:.2f} | "
              f"{r['resume_s']:.2f} | {r['peak_extra_mib']:,} | {r['bytes']:,} |")
    full = [r for r in rows if r["tuning"] == "full" and r["rank"] == 0 and r["method"] == "sharded"]
    per_param = full[0]["bytes"] / full[0]["params"]
    print(f"\nbytes per parameter in a full fine-tune checkpoint: {per_param:.1f} (weights + AdamW moments)")
    for name, p in (("2B", PARAMS_2B), ("7B", PARAMS_7B)):
        for w in (8, 64):
            print(f"{name} on {w} ranks: full gather holds {per_param * p / 2**30:,.0f} GiB on rank 0 and one writer; "
                  f"sharded {per_param * p / w / 2**30:,.1f} GiB per rank, {w} writers")
    shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()

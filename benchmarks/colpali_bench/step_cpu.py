"""CPU seconds per 1-process training step, colpali-engine vs raggedvl, on the same batches.

    OMP_NUM_THREADS=1 BENCH_VENV/bin/python benchmarks/colpali_bench/step_cpu.py colpali  [--steps 6]
    OMP_NUM_THREADS=1 BENCH_VENV/bin/python benchmarks/colpali_bench/step_cpu.py raggedvl [--steps 6]

Both sides start from the same checkpoint (default: the colpali-engine fixture
``shared/interop/colqwen2-tiny/colqwen2_full``) and collate the SAME rows of workload (a)
(``workloads.build_workload("uniform")``: rows ``8 i .. 8 i + 7`` of ``train.parquet`` at step
``i``), so the work is identical; ``--warmup`` steps run first, untimed. Per step, in this
process's CPU seconds (``time.process_time``: unlike wall time, hardly moved by other processes
on a shared machine) and wall seconds:

- colpali-engine: ``VisualRetrieverCollator`` (its processor at ``max_num_visual_tokens =
  max_pixels / 784``), ``ColQwen2`` forward of queries then documents, ``ColbertLoss(temperature
  0.02, normalize_scores=True)``, backward, clipping at 1.0 and fused AdamW (the HF Trainer's
  default on CPU): what ``ContrastiveTrainer`` runs per step, without the Trainer around it;
- raggedvl: its collator (``Trainer.c.collate``) and ``Trainer.train_step`` (the step
  ``raggedvl train`` runs: forward, late-interaction loss, backward, clipping, AdamW, the step
  statistics), built by ``raggedvl train``'s own parser from the benchmark's flags.

Prints one line per side: ``collate`` and ``step`` (model + loss + optimizer) CPU and wall
milliseconds per step, and the mean loss. Run it in the benchmark venv (``vs_colpali.sh``
builds it; colpali-engine needs torchvision), interleaving the sides.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from colpali_bench.workloads import build_workload  # noqa: E402

CHECKPOINT = Path(__file__).resolve().parents[3] / "shared" / "interop" / "colqwen2-tiny" / "colqwen2_full"


def colpali_side(checkpoint: str, parquet: str, max_pixels: int):
    from colpali_engine.collators import VisualRetrieverCollator
    from colpali_engine.data.dataset import ColPaliEngineDataset
    from colpali_engine.loss import ColbertLoss
    from colpali_engine.models import ColQwen2, ColQwen2Processor
    from datasets import load_dataset

    processor = ColQwen2Processor.from_pretrained(checkpoint, max_num_visual_tokens=max_pixels // 784)
    model = ColQwen2.from_pretrained(checkpoint, dtype=torch.float32).train()
    rows = ColPaliEngineDataset(load_dataset("parquet", data_files={"train": parquet}, split="train"),
                                query_column_name="query", pos_target_column_name="image")
    collate = VisualRetrieverCollator(processor=processor)
    loss_fn = ColbertLoss(temperature=0.02, normalize_scores=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-4, weight_decay=0.0, fused=True)

    def batch(indices):
        return collate([rows[i] for i in indices])

    def step(b) -> float:
        q = model(**{k.removeprefix("query_"): v for k, v in b.items() if k.startswith("query_")})
        d = model(**{k.removeprefix("doc_"): v for k, v in b.items() if k.startswith("doc_")})
        loss = loss_fn(q, d)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        return float(loss.detach())

    return len(rows), batch, step


def raggedvl_side(checkpoint: str, data_dir: str, max_pixels: int, out: str):
    from raggedvl.app.cli import build_parser
    from raggedvl.parallel.runtime import init_distributed
    from raggedvl.app.config import config_from_args
    from raggedvl.app.loop import Trainer

    argv = ["train", "--model", checkpoint, "--lora", "false", "--dataset", data_dir, "--max-train-samples", "none",
            "--max-eval-samples", "none", "--global-batch-size", "8", "--max-steps", "1000", "--lr", "5e-4",
            "--warmup-steps", "0", "--weight-decay", "0", "--max-grad-norm", "1.0", "--temperature", "0.02",
            "--max-pixels", str(max_pixels), "--precision", "fp32", "--eval-before", "false", "--eval-after", "false",
            "--output-dir", out, "--checkpoint-every", str(10**9)]
    trainer = Trainer(config_from_args(build_parser().parse_args(argv)), init_distributed())
    rows = trainer.c.train_set

    def batch(indices):
        return trainer.c.collate([rows[i] for i in indices])

    def step(b) -> float:
        return trainer.train_step(b).loss

    return len(rows), batch, step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("side", choices=["colpali", "raggedvl"])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--checkpoint", default=str(CHECKPOINT))
    p.add_argument("--max-pixels", type=int, default=200_704)
    p.add_argument("--work-dir", default="/tmp/raggedvl-step-cpu")
    args = p.parse_args()
    torch.set_num_threads(1)
    data = build_workload("uniform", Path(args.work_dir) / "data", train_pairs=8 * (args.steps + args.warmup), dev_pairs=8)
    if args.side == "colpali":
        n, batch, step = colpali_side(args.checkpoint, str(data / "train.parquet"), args.max_pixels)
    else:
        n, batch, step = raggedvl_side(args.checkpoint, str(data), args.max_pixels, str(Path(args.work_dir) / "run"))
    cpu = {"collate": 0.0, "step": 0.0}
    wall = dict(cpu)
    losses = []
    for i in range(args.warmup + args.steps):
        timed = i >= args.warmup
        c0, w0 = time.process_time(), time.perf_counter()
        b = batch([(8 * i + k) % n for k in range(8)])
        c1, w1 = time.process_time(), time.perf_counter()
        loss = step(b)
        c2, w2 = time.process_time(), time.perf_counter()
        if timed:
            cpu["collate"] += c1 - c0
            cpu["step"] += c2 - c1
            wall["collate"] += w1 - w0
            wall["step"] += w2 - w1
            losses.append(loss)
    ms = {k: round(v / args.steps * 1000, 1) for k, v in cpu.items()}
    wall_ms = {k: round(v / args.steps * 1000, 1) for k, v in wall.items()}
    print(f"{args.side}: CPU ms/step {ms} (total {sum(ms.values()):.1f}); wall ms/step {wall_ms}; "
          f"mean loss {sum(losses) / len(losses):.4f}", flush=True)


if __name__ == "__main__":
    main()

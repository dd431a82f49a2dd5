"""Padding-free sequences on CPU: padding tokens and step time, packed vs padded.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/packing.py [--repeats 7] [--batch 8]
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/packing.py --check     # seconds, for CI

One process, one thread, the tiny preset (TinySizes defaults), late-interaction loss at
temperature 0.02. A step is ``model(queries=q, docs=d)`` + loss + backward (no optimizer step,
so every mode sees the same weights and the losses must agree). Modes, on the same batches:

- padded: the collator's right-padded [B, L] rows (``--packing false``);
- packed, per-sequence SDPA: one row per encode call, the language model's attention run per
  sequence (``--packing true``, ``raggedvl.models.packed_attention``);
- packed, block-diagonal mask: the same rows through transformers' own ``sdpa`` packed path
  (one [T, T] block-diagonal causal mask per row).

Workloads (``benchmarks/colpali_bench/workloads.py``, shared with ``vs_colpali.py``):
``uniform``, rdocs pages as the embedded dataset renders them, at max_pixels 200,704 (the
workload (a)); ``heavy``, the heavy-tailed document mix (thumbnails, strips, crops, slides, full
pages, spreads) at max_pixels 1,003,520 (workload (b)).
The machine is shared: modes are interleaved within each repeat (rotating the order), times are
this process's CPU seconds (``time.process_time``; one thread, so CPU time is what an idle
machine's wall time would be, minus waiting for a core) beside the wall seconds, the ratio to
padded is taken per repeat, and the table gives the median ratio and the load average
(``uptime``) before and after.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from colpali_bench.workloads import WORKLOADS, build_workload  # noqa: E402
from raggedvl.data import RetrievalCollator, build_processor, load_retrieval_dataset  # noqa: E402
from raggedvl.data.cache import cache_root  # noqa: E402
from raggedvl.losses import make_retrieval_loss  # noqa: E402
from raggedvl.models import build_retriever  # noqa: E402
from raggedvl.models.packed_attention import set_packed_attention  # noqa: E402

MODES = ("padded", "packed, per-sequence SDPA", "packed, block-diagonal mask")


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return f"load average {os.getloadavg()[0]:.2f}"


def load_pairs(workload: str, train_pairs: int, dev_pairs: int, cache: Path | None):
    """The training split of ``workload`` at that size (a RetrievalDataset), rendered once and cached."""
    directory = build_workload(workload, cache_root(cache) / "bench", train_pairs=train_pairs, dev_pairs=dev_pairs)
    return load_retrieval_dataset(str(directory / "train.parquet"), split="train")


def padding_share(batches, key: str) -> float:
    """Share of the padded token slots of ``key`` ("queries" / "docs") that are padding."""
    real = sum(int(b[key]["attention_mask"].sum()) for b in batches)
    slots = sum(b[key]["attention_mask"].numel() for b in batches)
    return 1 - real / slots


def set_mode(model, mode: str) -> None:
    model.set_packing(mode != "padded")
    if mode == "packed, block-diagonal mask":
        set_packed_attention(model.base_model, False)  # packed rows, transformers' sdpa mask


def step(model, loss_fn, batch) -> tuple[float, float, float]:
    """CPU seconds (this process) and wall seconds of one forward + loss + backward, and the loss."""
    c0, t0 = time.process_time(), time.perf_counter()
    q, d = model(queries=batch["queries"], docs=batch["docs"])
    loss = loss_fn(q, d)
    loss.backward()
    cpu, wall = time.process_time() - c0, time.perf_counter() - t0
    model.zero_grad(set_to_none=True)
    return cpu, wall, float(loss.detach())


def run_workload(workload: str, args) -> dict:
    processor = build_processor("tiny", max_pixels=WORKLOADS[workload].max_pixels if not args.check else 50_176)
    n = args.batch * args.batches
    pairs = load_pairs(workload, n, 2, args.cache) if args.check else load_pairs(workload, max(n, 16), 8, args.cache)
    collate = RetrievalCollator(processor)
    batches = [collate([pairs[i] for i in range(k * args.batch, (k + 1) * args.batch)]) for k in range(args.batches)]
    model = build_retriever("tiny", processor=processor, seed=0).train()
    loss_fn = make_retrieval_loss("late_interaction", temperature=0.02)
    for mode in MODES:  # warm-up: one step per mode
        set_mode(model, mode)
        step(model, loss_fn, batches[0])
    cpu = {m: [] for m in MODES}
    wall = {m: [] for m in MODES}
    losses = {m: [] for m in MODES}
    ratios = {m: [] for m in MODES}
    for rep in range(args.repeats):
        order = MODES[rep % len(MODES):] + MODES[:rep % len(MODES)]
        per_rep = {m: [0.0, 0.0] for m in MODES}
        for mode in order:
            set_mode(model, mode)
            for batch in batches:
                c, w, loss = step(model, loss_fn, batch)
                per_rep[mode][0] += c
                per_rep[mode][1] += w
                if rep == 0:
                    losses[mode].append(loss)
        for mode in MODES:
            cpu[mode].append(per_rep[mode][0] / len(batches))
            wall[mode].append(per_rep[mode][1] / len(batches))
            ratios[mode].append(per_rep[mode][0] / per_rep["padded"][0])
    grids = torch.cat([b["docs"]["image_grid_thw"] for b in batches])
    patches = grids.prod(-1).double()
    return {
        "workload": workload, "batches": batches, "cpu": cpu, "wall": wall, "ratios": ratios, "losses": losses,
        "patches": (float(patches.min()), float(patches.median()), float(patches.max())),
    }


def report(results: list[dict], args, load_before: str, load_after: str) -> str:
    lines = [
        f"machine: {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, 1 thread; "
        f"{args.repeats} interleaved repeats x {args.batches} batches of {args.batch} pairs",
        f"load before: {load_before}",
        f"load after:  {load_after}",
        "",
        "| workload | doc patches min / median / max | mode | padding tokens: queries / docs | "
        "CPU s / step (median) | wall s / step (median) | CPU time vs padded (median of per-repeat ratios) | "
        "max abs loss diff vs padded |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        pq, pd = padding_share(r["batches"], "queries"), padding_share(r["batches"], "docs")
        lo, med, hi = r["patches"]
        for mode in MODES:
            diff = max(abs(a - b) for a, b in zip(r["losses"][mode], r["losses"]["padded"]))
            pad = f"{pq:.1%} / {pd:.1%}" if mode == "padded" else "0 % / 0 %"
            lines.append(
                f"| {r['workload']} | {lo:.0f} / {med:.0f} / {hi:.0f} | {mode} | {pad} | "
                f"{statistics.median(r['cpu'][mode]):.3f} | {statistics.median(r['wall'][mode]):.3f} | "
                f"{statistics.median(r['ratios'][mode]):.2f}x | {diff:.1e} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default="uniform,heavy", help="comma-separated: uniform, heavy")
    p.add_argument("--batch", type=int, default=8, help="pairs per step (queries + documents of one rank)")
    p.add_argument("--batches", type=int, default=2, help="distinct batches per repeat")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--cache", type=Path, default=None, help="where rendered pairs are cached")
    p.add_argument("--check", action="store_true", help="tiny sizes, 1 repeat, uniform only: a smoke test")
    args = p.parse_args(argv)
    if args.check:
        args.workloads, args.batch, args.batches, args.repeats = "uniform", 2, 1, 1
    torch.set_num_threads(1)
    load_before = uptime()
    results = []
    for workload in [w.strip() for w in args.workloads.split(",") if w.strip()]:
        results.append(run_workload(workload, args))
        print(f"{workload} done ({uptime()})", flush=True)
    print(report(results, args, load_before, uptime()), flush=True)
    worst = max(abs(a - b) for r in results for m in MODES for a, b in zip(r["losses"][m], r["losses"]["padded"]))
    return 0 if worst < 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())

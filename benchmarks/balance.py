"""Rank balance of the cost-balanced sampler vs equal-count sharding, sampler speed, and the
cost model's accuracy on the tiny model.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/balance.py [--steps 200] [--calibrate]

Distributions:
- rdocs: the (width, height) of all ~1,650 rdocs pairs, computed from engineer D's render plan
  (page size in points x dpi / 72, within one pixel of the rendered PNGs) without rendering,
  through the Qwen2-VL resize rule with max_pixels 1,003,520 (transformers' default); text per
  pair = 16 prompt tokens + 1.5 tokens per query word.
- heavy: a synthetic heavy-tailed mix: pixel areas Pareto(alpha=1.1) from 28x28 up, aspect
  0.5-2, max_pixels 16 Mi (so 4-megapixel images keep their quadratic attention cost).
Costs use the default ``CostModel`` (relative units). For each (W, G) the same global batches
(drop_last, epochs chained until --steps steps) are split two ways: equal-count (contiguous
chunks of the permuted global batch, sizes differing by at most one) and this sampler's
partition. Reported: mean over steps of max/mean rank cost and of max / lower bound, where the
lower bound is max(mean rank cost, largest single sample) -- no partition can beat it.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import time

import numpy as np
import torch

from raggedvl.images import ImagePolicy
from raggedvl.sampling import BalancedDistributedBatchSampler, estimate_costs, global_batches, partition_costs

RDOCS_MAX_PIXELS = 1_003_520


def rdocs_sizes() -> tuple[list[tuple[int, int]], list[int], list]:
    from raggedvl.data.rdocs import open_manuals
    from raggedvl.data.rdocs_pairs import plan_pairs

    manuals = open_manuals()
    plans = plan_pairs(manuals)

    def page(pdf, index, scale, crop):
        w, h = manuals[pdf][index].get_size()
        if crop is not None:
            h = abs(crop[0] - crop[1])
        return math.ceil(w * scale), math.ceil(h * scale)

    sizes = []
    for p in plans:
        scale = p.dpi / 72.0
        if p.view == "spread":
            (w0, h0), (w1, h1) = (page(p.pdf, i, scale, None) for i in p.pages)
            sizes.append((w0 + w1, max(h0, h1)))
        else:
            sizes.append(page(p.pdf, p.page, scale, p.crop_pt))
    text = [16 + int(1.5 * len(p.query.split())) for p in plans]
    return sizes, text, plans


def heavy_sizes(n: int, seed: int = 0) -> list[tuple[int, int]]:
    rng = np.random.default_rng(seed)
    area = np.minimum(784.0 * (1.0 + rng.pareto(1.1, n)), 16e6)
    aspect = rng.uniform(0.5, 2.0, n)
    return [(max(28, int(math.sqrt(a * r))), max(28, int(math.sqrt(a / r)))) for a, r in zip(area, aspect)]


def step_batches(costs: np.ndarray, g: int, w: int, steps: int, **kw) -> list[np.ndarray]:
    out, epoch = [], 0
    while len(out) < steps:
        out += global_batches(costs, g, w, seed=0, epoch=epoch, drop_last=True, **kw)
        epoch += 1
    return out[:steps]


def ratios(costs: np.ndarray, batch: np.ndarray, parts: list[list[int]]) -> tuple[float, float]:
    loads = np.array([costs[batch[p]].sum() for p in parts])
    mean = loads.sum() / len(parts)
    bound = max(mean, costs[batch].max())
    return loads.max() / mean, loads.max() / bound


def balance_rows(name: str, costs: np.ndarray, steps: int) -> list[tuple]:
    rows = []
    for w in (2, 8, 64):
        for g in (64, 256):
            acc = {k: [] for k in ("eq", "lpt", "bal")}
            bound_over_mean = []
            for batch in step_batches(costs, g, w, steps):
                c = costs[batch].tolist()
                equal = [list(chunk) for chunk in np.array_split(np.arange(g), w)]
                acc["eq"].append(ratios(costs, batch, equal))
                acc["lpt"].append(ratios(costs, batch, partition_costs(c, w, refine_rounds=0)))
                acc["bal"].append(ratios(costs, batch, partition_costs(c, w)))
                bound_over_mean.append(acc["bal"][-1][0] / acc["bal"][-1][1])
            m = {k: np.mean(v, axis=0) for k, v in acc.items()}
            rows.append((name, w, g, steps, m["eq"][0], m["lpt"][0], m["bal"][0], np.mean(bound_over_mean),
                         m["eq"][1], m["lpt"][1], m["bal"][1]))
    return rows


def print_balance(rows: list[tuple]) -> None:
    print("| data | W | G | steps | equal max/mean | LPT max/mean | balanced max/mean | bound/mean "
          "| equal max/bound | LPT max/bound | balanced max/bound |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} | " + " | ".join(f"{v:.4f}" for v in r[4:]) + " |")


def homogeneous_rows(costs: np.ndarray, steps: int) -> None:
    print("\nHomogeneous steps (rdocs, W=8, G=64): balance, within-step cost spread, step-to-step spread")
    print("| mode | max/mean | max/bound | within-step cost CV | step total cost CV |")
    print("|---|---:|---:|---:|---:|")
    for mode, kw in (("mixed", {}), ("homogeneous, 32-step pools", {"homogeneous": True, "bucket_steps": 32})):
        rs, cv, totals = [], [], []
        for batch in step_batches(costs, 64, 8, steps, **kw):
            rs.append(ratios(costs, batch, partition_costs(costs[batch].tolist(), 8)))
            cv.append(costs[batch].std() / costs[batch].mean())
            totals.append(costs[batch].sum())
        m = np.mean(rs, axis=0)
        print(f"| {mode} | {m[0]:.4f} | {m[1]:.4f} | {np.mean(cv):.3f} | {np.std(totals) / np.mean(totals):.3f} |")


def sampler_speed(name: str, costs: np.ndarray, steps: int) -> None:
    """Whole-epoch plans through the sampler (permutation, global batches, partition of every
    step), divided by the steps, in this process's CPU time (the machine is shared); beside it
    the same steps partitioned by LPT alone, the cost floor of any greedy-first method."""
    sampler = BalancedDistributedBatchSampler(costs, 256, 64, 0, drop_last=True)
    cpu, lpt, done, epoch = [], [], 0, 0
    while done < steps:
        sampler.set_epoch(epoch)
        c0 = time.process_time()
        n = len(sampler.plan())
        cpu.append((time.process_time() - c0) / n)
        batches = global_batches(costs, 256, 64, seed=0, epoch=epoch, drop_last=True)
        c0 = time.process_time()
        for batch in batches:
            partition_costs(costs[batch].tolist(), 64, refine_rounds=0)
        lpt.append((time.process_time() - c0) / len(batches))
        done, epoch = done + n, epoch + 1
    c, g = np.array(cpu) * 1e3, np.array(lpt) * 1e3
    print(f"| {name} | 256 | 64 | {done} | {c.min():.3f} | {np.median(c):.3f} | {g.min():.3f} | {np.median(g):.3f} |")


def rounds_tradeoff(datasets: dict[str, np.ndarray], steps: int) -> None:
    """Quality vs CPU time of the refinement's round budget (0 = LPT alone); every batch is
    partitioned with each budget in turn, so load drift on a shared machine hits all alike."""
    budgets = (0, 1, 2, 4, 8, 64)
    cells = [(name, g, w) for name in datasets for g, w in ((256, 64), (64, 8))]
    results = {}
    for name, g, w in cells:
        costs = datasets[name]
        rs, ts = np.zeros((len(budgets), steps)), np.zeros((len(budgets), steps))
        for j, batch in enumerate(step_batches(costs, g, w, steps)):
            c = costs[batch].tolist()
            for i, rounds in enumerate(budgets):
                t0 = time.process_time()
                parts = partition_costs(c, w, refine_rounds=rounds)
                ts[i, j] = time.process_time() - t0
                rs[i, j] = ratios(costs, batch, parts)[1]
        results[(name, g, w)] = (rs.mean(axis=1), np.median(ts, axis=1) * 1e3)
    print("\nRefinement rounds: mean max/bound and median CPU ms per partition")
    print("| rounds | " + " | ".join(f"{n} G={g} W={w}" for n, g, w in cells) + " |")
    print("|---:|" + "---:|" * len(cells))
    for i, rounds in enumerate(budgets):
        row = [f"{results[cell][0][i]:.4f} / {results[cell][1][i]:.2f} ms" for cell in cells]
        print(f"| {rounds} | " + " | ".join(row) + " |")


def calibrate_tiny(plans: list, n: int) -> None:
    from raggedvl.batch.costs import CostModel, cost_features
    from raggedvl.data.processing import build_processor
    from raggedvl.data.rdocs import open_manuals, render_pair
    from raggedvl.models import build_retriever
    from raggedvl.sampling import calibrate, relative_errors

    torch.manual_seed(0)
    torch.set_num_threads(1)
    manuals = open_manuals()
    processor = build_processor("tiny")
    model = build_retriever("tiny", processor=processor, seed=0)
    chosen = [plans[i] for i in np.random.default_rng(0).permutation(len(plans))[:n]]
    inputs, feats = [], []
    for p in chosen:
        image = render_pair(manuals[p.pdf], p).convert("RGB")
        text = f"<|vision_start|><|image_pad|><|vision_end|>Describe the page. {p.query}"
        batch = dict(processor(images=[image], text=[text], return_tensors="pt"))
        inputs.append(batch)
        feats.append(cost_features(batch["image_grid_thw"], [1], torch.tensor([batch["input_ids"].shape[1]]))[0])
    feats = torch.stack(feats).numpy()

    def run(batch):
        model.zero_grad(set_to_none=True)
        model(**batch).embeddings.sum().backward()

    result = calibrate(run, inputs, feats, repeats=7, warmup=2, reduce="min")
    default = feats @ CostModel().coefficients.numpy()
    scale = np.median(result.measured / default)  # best-case units for the uncalibrated model
    print(f"\nCost model accuracy on the tiny model ({n} rdocs docs, forward+backward, batch 1, min of 7 round-robin passes,"
          f" tiny processor max_pixels {processor.image_processor.size['longest_edge']}):")
    print("| model | fitted on | mean abs rel error (held out) | mean abs rel error (fitted half) |")
    print("|---|---|---:|---:|")
    print(f"| calibrated NNLS {result.cost_model} | even half | {result.heldout_error:.3f} | {result.fit_error:.3f} |")
    err = relative_errors(default * scale, result.measured)
    print(f"| default CostModel x median scale | - | {err[1::2].mean():.3f} | {err[0::2].mean():.3f} |")
    print(f"measured per-sample time: min {result.measured.min()*1e3:.1f} ms, max {result.measured.max()*1e3:.1f} ms")


def training_runs(run_dirs: list[str]) -> None:
    """Per-step rank compute times from ``raggedvl train`` runs (their metrics.jsonl, written
    with --log-every 1): the loop logs each rank's encode (forward) seconds per step."""
    import json
    from pathlib import Path

    print("\nReal training runs: per-step slowest-rank / mean-rank encode time (forward, seconds)")
    print("| run | sampler | W | G | steps | mean slowest/mean | mean slowest (s) | mean rank (s) | mean step (s) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for run in run_dirs:
        rows = [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines() if line.strip()]
        config = next(r for r in rows if r.get("event") == "config")
        steps = [r for r in rows if r.get("event") == "train"]
        enc = np.array([r["rank_encode_s"] for r in steps])
        ratio = enc.max(axis=1) / enc.mean(axis=1)
        print(f"| {run} | {config['sampler']} | {config['world_size']} | {config['global_batch_size']} | {len(steps)} "
              f"| {ratio.mean():.3f} | {enc.max(axis=1).mean():.3f} | {enc.mean():.3f} "
              f"| {np.mean([r['step_s'] for r in steps]):.3f} |")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200, help="global steps per (data, W, G) cell")
    ap.add_argument("--calibrate", type=int, default=0, metavar="N",
                    help="also time N rdocs docs on the tiny model and fit the cost model")
    ap.add_argument("--runs", nargs="+", metavar="RUN_DIR",
                    help="only summarise these raggedvl train output dirs (metrics.jsonl) and exit")
    args = ap.parse_args(argv)
    if args.runs:
        training_runs(args.runs)
        return
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cpus, "
          f"python {platform.python_version()}, torch {torch.__version__}, "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}")
    sizes, text, plans = rdocs_sizes()
    rdocs = estimate_costs(sizes, text, policy=ImagePolicy(max_pixels=RDOCS_MAX_PIXELS)).costs
    heavy = estimate_costs(heavy_sizes(4000), 24, policy=ImagePolicy(max_pixels=16 * 1024 * 1024)).costs
    print(f"rdocs: {len(rdocs)} pairs, cost max/median {rdocs.max() / np.median(rdocs):.1f}; "
          f"heavy: {len(heavy)} samples, cost max/median {heavy.max() / np.median(heavy):.1f}\n")
    print_balance(balance_rows("rdocs", rdocs, args.steps) + balance_rows("heavy", heavy, args.steps))
    homogeneous_rows(rdocs, args.steps)
    print(f"\nSampler CPU time per step (ms over epochs; every rank plans all W shares; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cpus)")
    print("| data | G | W | steps | sampler min | sampler median | LPT-only min | LPT-only median |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    sampler_speed("rdocs", rdocs, args.steps)
    sampler_speed("heavy", heavy, args.steps)
    rounds_tradeoff({"rdocs": rdocs, "heavy": heavy}, min(args.steps, 100))
    if args.calibrate:
        calibrate_tiny(plans, args.calibrate)


if __name__ == "__main__":
    main()

"""The step's planning at W = 64 and 256 ranks, simulated with a Qwen2-VL-2B cost model.

    OMP_NUM_THREADS=1 python benchmarks/plan_scale.py [--worlds 64 256] [--per-rank 2 8] [--steps 50]
    OMP_NUM_THREADS=1 python benchmarks/plan_scale.py --report benchmarks/results/plan_scale.md

The sampler simulation of ``benchmarks/balance.py`` (same two size distributions: rdocs from
its render plan without rendering, and the heavy-tailed Pareto mix, both through the Qwen2-VL
resize rule at ``--max-pixels``, default 1,003,520 as in the 2B recipe) and the encoder rebalancing
plan of ``benchmarks/vision_balance.py``, taken to 256 ranks, with costs in Qwen2-VL-2B
forward multiply-accumulates instead of relative units. Per (data, W, samples per rank b), the
global batch G = b W, every step of ``--steps``:

- planning CPU time per step (this process, ``time.process_time``, the least of 3 calls): the sampler's plan
  (``raggedvl.sampling.plan_epoch``: global batch, then the cost-balanced partition into W
  shares, which every rank computes alike), and the encoder rebalancing plan
  (``raggedvl.parallel.plan_vision_balance`` on the step's per-image tower costs, what
  ``--rebalance-vision`` computes on every rank after gathering the grids);
- bytes one rank receives per step in the step's all-gathers and all-reduces outside the
  gradient all-reduce of the model (which does not depend on W): the loss's positives gather
  (``all_gather_packed``: W buffers of max_r T_r x D values, T_r the real tokens of rank r's
  documents, D = 128, ``--value-bytes`` 4: the head's output is float32 under bf16 autocast
  too, plus each document's token count, int64), the all-reduce of the real vectors' gradient
  in backward ([sum_r T_r, D]; a ring all-reduce receives 2 (W - 1) / W of it), and
  the small gathers (one int64 header of 7 + MAX_DIMS per rank for each of the positives,
  negatives, keys and vision-grid gathers; the keys, two int64 per sample; the grids, 3 int64
  per image plus a header row, padded to the largest rank; the per-rank statistics,
  ``stat_floats()`` float64 per rank). Beside it the ragged minimum: every document's own tokens
  once, sum_i L_i x D values;
- balance: the mean over steps of slowest / mean rank cost, of the bound
  max(mean, largest sample) / mean, and of slowest / bound (1: no partition does better).

The 2B cost model (``qwen2_vl_2b_cost_model``) counts forward multiply-accumulates from the
published Qwen2-VL-2B configuration: vision tower depth 32, width 1,280, MLP ratio 4, patch 14,
2 x 2 merge into the decoder's width 1,536; decoder 28 layers, 12 query and 2 key/value heads of
128, MLP 8,960. The decoder's attention (quadratic in tokens) is left out, as the cost model has
no such term: 2 x 28 x 1,536 x L multiply-accumulates per token, 8 % of a token's cost at
L = 1,300. Pure arithmetic and CPU timing: no model runs.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from dataclasses import fields
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from balance import RDOCS_MAX_PIXELS, heavy_sizes, rdocs_sizes  # noqa: E402

EMBED_DIM = 128  # the late-interaction head's D
DOC_PROMPT_TOKENS = 16  # a document's text tokens around its image (chat template and prompt)


def qwen2_vl_2b_cost_model():
    """``CostModel`` in forward multiply-accumulates (MACs) of Qwen2-VL-2B (module docstring)."""
    from raggedvl.batch import CostModel

    d, depth, patch, merge = 1280, 32, 14, 2
    h, layers, kv, head_dim, mlp = 1536, 28, 2, 128, 8960
    per_patch = (depth * 12 * d * d  # qkv 3 D^2, output D^2, MLP 2 x 4 D^2, per block
                 + 3 * 2 * patch * patch * d  # patch embedding (3 channels, 2 frames, 14 x 14)
                 + ((merge**2 * d) ** 2 + merge**2 * d * h) / merge**2)  # merger MLP, per patch of a 2 x 2 group
    per_patch_pair = depth * 2 * d  # attention scores and values over an image's patches
    per_token = layers * (2 * h * h + 2 * h * kv * head_dim + 3 * h * mlp)
    return CostModel(per_sample=0.0, per_patch=per_patch, per_patch_pair=per_patch_pair, per_token=per_token)


def stat_floats() -> int:
    """Float64 values per rank in the training loop's per-step statistics gather."""
    from raggedvl.app.loop import RankStep
    from raggedvl.app.progress import PADDING_KEYS

    return 3 + len(fields(RankStep)) - 1 + len(PADDING_KEYS)  # loss, norm, cosine; padding as its keys


def step_bytes(parts: list[np.ndarray], doc_len: np.ndarray, images: np.ndarray, value_bytes: int,
               header_values: int, stats: int) -> dict[str, float]:
    """Bytes one rank receives in one step's gathers (module docstring), for the plan ``parts``."""
    w = len(parts)
    n = np.array([len(p) for p in parts])
    longest = np.array([doc_len[p].max() if len(p) else 0 for p in parts])
    tokens = np.array([doc_len[p].sum() if len(p) else 0 for p in parts])
    l_max = int(longest.max())
    gather = w * int(tokens.max()) * EMBED_DIM * value_bytes + w * int(n.max()) * 8
    backward = 2 * (w - 1) / w * int(tokens.sum()) * EMBED_DIM * value_bytes
    grid_rows = max(1 + int(images[p].sum()) for p in parts)
    small = w * 8 * (4 * header_values + 2 * int(n.max()) + 3 * grid_rows + stats)
    ragged = float(doc_len[np.concatenate(parts)].sum()) * EMBED_DIM * value_bytes
    return {"gather": float(gather), "backward": backward, "small": float(small), "ragged": ragged,
            "l_max": float(l_max)}


def timed(fn, repeats: int = 3):
    """(``fn()``, the least CPU seconds of ``repeats`` calls): the machine is shared, so the
    fastest call is the one least disturbed."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.process_time()
        result = fn()
        best = min(best, time.process_time() - t0)
    return result, best


def simulate(costs, tower: np.ndarray, doc_len: np.ndarray, world: int, per_rank: int, *, steps: int, seed: int,
             value_bytes: int, header_values: int, stats: int) -> dict:
    """Per-step means over ``steps`` steps at ``world`` ranks (module docstring); samples are
    tiled so that one epoch holds at least 4 global batches. Each sample holds one image."""
    from raggedvl.parallel import plan_vision_balance
    from raggedvl.parallel.vision_plan import DEFAULT_TOLERANCE
    from raggedvl.sampling import plan_epoch

    g = world * per_rank
    reps = max(1, -(-4 * g // len(costs)))
    c_v, t_v, l_v = np.tile(costs, reps), np.tile(tower, reps), np.tile(doc_len, reps)
    ones = np.ones(len(c_v), dtype=np.int64)
    out: dict[str, list[float]] = {k: [] for k in ("sampler_ms", "vision_ms", "max_over_mean", "bound",
                                                   "max_over_bound", "gather",
                                                   "backward", "small", "ragged", "max_n", "l_max")}
    epoch = 0
    while len(out["max_over_mean"]) < steps:
        plan, seconds = timed(lambda: plan_epoch(c_v, g, world, seed=seed, epoch=epoch, drop_last=True))
        out["sampler_ms"] += [seconds * 1e3 / len(plan)] * len(plan)
        for parts in plan:
            parts = [np.asarray(p, dtype=np.int64) for p in parts]
            tower_costs = [t_v[p].tolist() for p in parts]
            _, seconds = timed(lambda: plan_vision_balance(tower_costs, tolerance=DEFAULT_TOLERANCE))
            out["vision_ms"].append(seconds * 1e3)
            loads = np.array([c_v[p].sum() for p in parts])
            mean = loads.mean()
            out["max_over_mean"].append(loads.max() / mean)
            out["bound"].append(max(mean, c_v[np.concatenate(parts)].max()) / mean)
            out["max_over_bound"].append(out["max_over_mean"][-1] / out["bound"][-1])
            for k, v in step_bytes(parts, l_v, ones, value_bytes, header_values, stats).items():
                out[k].append(v)
            out["max_n"].append(max(len(p) for p in parts))
            if len(out["max_over_mean"]) == steps:
                break
        epoch += 1
    res = {k: float(np.mean(v)) for k, v in out.items()}
    res["sampler_ms"] = float(np.median(out["sampler_ms"]))
    res["vision_ms"] = float(np.median(out["vision_ms"]))
    return {"world": world, "per_rank": per_rank, "g": g, "steps": len(out["max_over_mean"]), **res}


def table(rows: list[dict]) -> str:
    mib = 2.0**20
    lines = [
        "| data | W | G | sampler plan ms/step | vision plan ms/step | plan us/sample | positives gather MiB "
        "| its backward all-reduce MiB | KiB/sample | ragged minimum MiB | small gathers KiB | most samples on a rank "
        "| longest doc (tokens) | slowest/mean rank | bound/mean | slowest/bound |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        per_sample = (r["gather"] + r["backward"]) / r["g"] / 1024
        plan_us = (r["sampler_ms"] + r["vision_ms"]) * 1e3 / r["g"]
        lines.append(
            f"| {r['data']} | {r['world']} | {r['g']} | {r['sampler_ms']:.2f} | {r['vision_ms']:.2f} | {plan_us:.2f} "
            f"| {r['gather'] / mib:.1f} | {r['backward'] / mib:.1f} | {per_sample:.1f} | {r['ragged'] / mib:.1f} "
            f"| {r['small'] / 1024:.1f} | {r['max_n']:.1f} | {r['l_max']:.0f} | {r['max_over_mean']:.4f} "
            f"| {r['bound']:.4f} | {r['max_over_bound']:.4f} |")
    return "\n".join(lines)


def growth(rows: list[dict]) -> str:
    """Per (data, b): each per-step figure at the largest W over the smallest, beside G's ratio."""
    lines = ["| data | b | G ratio | sampler plan | vision plan | positives gather + backward | ragged minimum "
             "| small gathers | slowest/bound |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for key in sorted({(r["data"], r["per_rank"]) for r in rows}):
        cells = sorted((r for r in rows if (r["data"], r["per_rank"]) == key), key=lambda r: r["world"])
        a, b = cells[0], cells[-1]
        if a is b:
            continue
        ratio = lambda k: b[k] / a[k]  # noqa: E731
        lines.append(f"| {key[0]} | {key[1]} | {b['g'] / a['g']:.1f} | {ratio('sampler_ms'):.1f} | "
                     f"{ratio('vision_ms'):.1f} | {(b['gather'] + b['backward']) / (a['gather'] + a['backward']):.1f} "
                     f"| {ratio('ragged'):.1f} | {ratio('small'):.1f} | {ratio('max_over_bound'):.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from raggedvl.batch import CostModel
    from raggedvl.images import ImagePolicy
    from raggedvl.parallel.agreement import MAX_DIMS
    from raggedvl.sampling import estimate_costs

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worlds", type=int, nargs="+", default=[64, 256])
    p.add_argument("--per-rank", type=int, nargs="+", default=[2, 8], help="samples per rank per step")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--value-bytes", type=int, default=4, help="bytes per embedding value (4: the head's float32)")
    p.add_argument("--max-pixels", type=int, default=RDOCS_MAX_PIXELS,
                   help="image budget of both distributions (default: Qwen2-VL's, the 2B recipe's)")
    p.add_argument("--report", default=None, help="also write the tables (markdown) here")
    args = p.parse_args(argv)
    model = qwen2_vl_2b_cost_model()
    sizes, text, _ = rdocs_sizes()
    data = {"rdocs": (sizes, text), "heavy": (heavy_sizes(4000), 24)}
    policy = ImagePolicy(max_pixels=args.max_pixels)
    rows = []
    for name, (sz, txt) in data.items():
        est = estimate_costs(sz, txt, cost_model=model, policy=policy)
        doc_len = estimate_costs(sz, DOC_PROMPT_TOKENS, policy=policy).seq_lens
        patches = est.patches.astype(np.float64)
        tower = model.per_patch * patches + model.per_patch_pair * patches**2
        for w in args.worlds:
            for b in args.per_rank:
                row = simulate(est.costs, tower, doc_len, w, b, steps=args.steps, seed=args.seed,
                               value_bytes=args.value_bytes, header_values=7 + MAX_DIMS, stats=stat_floats())
                rows.append({"data": name, **row})
    default = CostModel()
    head = [
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cpus, python "
        f"{platform.python_version()}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, load average "
        f"{os.getloadavg()[0]:.1f}",
        f"2B cost model (forward MACs): per_patch {model.per_patch:,.0f}, per_patch_pair {model.per_patch_pair:,.0f}, "
        f"per_token {model.per_token:,.0f}, max_pixels {args.max_pixels:,} (patch / patch-pair {model.per_patch / model.per_patch_pair:,.0f}; "
        f"the default CostModel's {default.per_patch / default.per_patch_pair:,.0f}); {args.steps} steps per cell, "
        f"embeddings {args.value_bytes} bytes per value, D {EMBED_DIM}",
    ]
    text_out = "\n".join(head) + "\n\n" + table(rows) + "\n\nGrowth from W = {} to W = {} (ratios):\n\n".format(
        min(args.worlds), max(args.worlds)) + growth(rows)
    print(text_out)
    if args.report:
        Path(args.report).write_text(text_out + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

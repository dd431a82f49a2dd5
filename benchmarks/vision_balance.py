"""Encoder rebalancing, simulated: vision-tower load per rank at W ranks on workload (b).

    python benchmarks/vision_balance.py                      # W = 8, 64; per-rank batch 1, 2, 8
    python benchmarks/vision_balance.py --report benchmarks/results/vision_balance.md

Workload (b) is the heavy-tailed document mix of ``benchmarks/vs_colpali.py``
(``colpali_bench/workloads.py``: thumbnails, strips, crops, slides, full pages and two-page
spreads at max_pixels 1,003,520; built once, reused from ``--work-dir``). Per image, the tower
cost is ``CostModel().image_costs`` (patches + patches**2 / 8192, the raggedvl default) after
the Qwen2-VL resize rule. Global batches and their split over ranks come from raggedvl's own
sampler plan (``raggedvl.sampling.plan_epoch`` on the sampler's per-sample cost estimates, as
``raggedvl train`` balances whole steps), and, for comparison, equal-count shards (colpali-engine).
Each step's tower loads are then rebalanced by ``raggedvl.parallel.plan_vision_balance``, the plan
``--rebalance-vision`` runs (default tolerance 5 %). Reported per (W, per-rank batch): the mean over steps of
slowest / mean rank tower load (1.0 is perfect), without and with rebalancing, the bound
max(mean, largest image) / mean, the images moved per step, and the step-time ratio in cost-model
units: without rebalancing a step takes max_r(tower_r + decoder_r); with it the feature exchange
is a sync point, so max_r tower_r (after) + max_r decoder_r (>1: rebalancing is faster). Pure arithmetic: no model runs,
no timing, the same figures on every machine.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from colpali_bench.workloads import WORKLOADS, build_workload, load_sizes  # noqa: E402


def tower_costs(sizes: list[tuple[int, int]], max_pixels: int) -> tuple[np.ndarray, np.ndarray]:
    """(per-image tower cost [N], the sampler's per-sample cost estimate [N]) for (w, h) images."""
    from raggedvl.batch import CostModel
    from raggedvl.images import ImagePolicy
    from raggedvl.sampling import estimate_costs

    est = estimate_costs(sizes, 32, policy=ImagePolicy(max_pixels=max_pixels))
    patches = est.patches.astype(np.float64)
    model = CostModel()
    tower = model.per_patch * patches + model.per_patch_pair * patches**2
    return tower, est.costs.astype(np.float64)


def simulate(tower: np.ndarray, estimate: np.ndarray, world: int, per_rank: int, *, steps: int, seed: int) -> dict:
    """Mean tower max/mean over ``steps`` steps: sampler plan and equal-count shards, each before
    and after rebalancing (one image per sample, as in workload b)."""
    from raggedvl.parallel import plan_vision_balance
    from raggedvl.parallel.vision_plan import DEFAULT_TOLERANCE
    from raggedvl.sampling import global_batches, plan_epoch

    g = world * per_rank
    reps = max(1, -(-4 * g // len(tower)))
    t_v, c_v = np.tile(tower, reps), np.tile(estimate, reps)
    lm_v = c_v - t_v  # the language-model part of the sampler's estimate (tokens)
    keys = ("plan", "plan_rebalanced", "equal", "equal_rebalanced", "bound", "moved", "step", "step_rebalanced")
    out = {k: [] for k in keys}
    epoch = 0
    while len(out["plan"]) < steps:
        batches = global_batches(c_v, g, world, seed=seed, epoch=epoch, drop_last=True)
        plan = plan_epoch(c_v, g, world, seed=seed, epoch=epoch, drop_last=True)
        for batch, parts in zip(batches, plan):
            for name, split in (("plan", parts), ("equal", np.array_split(batch, world))):
                vp = plan_vision_balance([t_v[list(p)].tolist() for p in split], tolerance=DEFAULT_TOLERANCE)
                out[name].append(vp.max_over_mean_before)
                out[f"{name}_rebalanced"].append(vp.max_over_mean_after)
                if name == "plan":
                    out["moved"].append(vp.moved)
                    # the exchange is a sync point: tower phase and decoder phase each wait for their slowest rank
                    lm = np.array([lm_v[list(p)].sum() for p in parts])
                    tw = np.array(vp.loads_before)
                    out["step"].append(float((tw + lm).max()))
                    out["step_rebalanced"].append(float(max(vp.loads_after) + lm.max()) if vp.moved else float((tw + lm).max()))
            mean = t_v[batch].sum() / world
            out["bound"].append(max(mean, t_v[batch].max()) / mean)
            if len(out["plan"]) == steps:
                break
        epoch += 1
    res = {k: float(np.mean(v)) for k, v in out.items()}
    res["step_ratio"] = float(np.mean(out["step"]) / np.mean(out["step_rebalanced"]))
    return {"world": world, "per_rank": per_rank, "steps": steps, **res}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worlds", type=int, nargs="+", default=[8, 64])
    p.add_argument("--per-rank", type=int, nargs="+", default=[1, 2, 8], help="samples per rank per step")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train-pairs", type=int, default=None, help="fewer pairs of workload (b), for a quick check")
    p.add_argument("--work-dir", default=str(Path.home() / ".cache" / "raggedvl" / "vs_colpali"))
    p.add_argument("--report", default=None, help="also write the table (markdown) here")
    args = p.parse_args(argv)
    spec = WORKLOADS["heavy"]
    data = build_workload("heavy", Path(args.work_dir) / "workloads", train_pairs=args.train_pairs)
    sizes = [(w, h) for w, h, _ in load_sizes(data)]
    tower, estimate = tower_costs(sizes, spec.max_pixels)
    rows = [simulate(tower, estimate, w, b, steps=args.steps, seed=args.seed) for w in args.worlds for b in args.per_rank]
    lines = [
        f"Vision-tower load per rank, simulated on workload (b) ({len(sizes)} pairs, max_pixels {spec.max_pixels:,}; "
        f"tower cost per image = patches + patches^2/8192, largest/median image "
        f"{tower.max() / np.median(tower):.0f}x); mean over {args.steps} steps of slowest / mean rank tower load.",
        "",
        "| W | samples per rank | raggedvl plan | + rebalancing | equal-count shards | + rebalancing | bound max(mean, largest)/mean "
        "| images moved per step (plan) | step speed-up from rebalancing (plan, cost model) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['world']} | {r['per_rank']} | {r['plan']:.2f} | {r['plan_rebalanced']:.2f} | {r['equal']:.2f} | "
                     f"{r['equal_rebalanced']:.2f} | {r['bound']:.2f} | {r['moved']:.1f} | {r['step_ratio']:.3f} |")
    text = "\n".join(lines)
    print(text)
    if args.report:
        Path(args.report).write_text(f"# Encoder rebalancing, simulated\n\n`python benchmarks/vision_balance.py`\n\n{text}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Workload (c): step time at W ranks simulated from per-sample step costs measured on workload (b).

Model: a rank's step time is the sum of its samples' measured costs (forward + backward of the
sample's query and document alone, one thread; see ``sample_costs.py``); a step takes as long
as its slowest rank (the gradient all-reduce waits for it). Text padding inside a rank and the
communication time are left out on both sides alike.

Global batches of G = W x per-rank batch samples come from raggedvl's own
``raggedvl.sampling.global_batches`` (seeded permutation, epochs chained; the measured set is
tiled so one epoch holds at least 4 global batches). Each global batch is split two ways:

- equal count, as colpali-engine (HF Trainer + accelerate) shards: every rank gets the same
  number of consecutive samples of the global batch, whatever their size;
- raggedvl's plan: ``raggedvl.sampling.plan_epoch`` on the SAME global batches, from the costs
  raggedvl's sampler estimates from image sizes (``estimate_costs``, as ``raggedvl train``
  does), not from the measured times, so the estimate's error counts against it.

Reported per W: mean step time of each, their ratio (= samples/s ratio, the same samples per
step), the mean over steps of slowest / mean rank time, and the lower bound
max(mean rank time, largest single sample).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SimRow:
    world_size: int
    global_batch: int
    steps: int
    equal_step_s: float
    raggedvl_step_s: float
    bound_step_s: float
    equal_max_over_mean: float
    raggedvl_max_over_mean: float

    @property
    def speedup(self) -> float:
        return self.equal_step_s / self.raggedvl_step_s


def simulate(measured_s: np.ndarray, estimated_cost: np.ndarray, world_size: int, per_rank_batch: int,
             *, steps: int = 200, seed: int = 0) -> SimRow:
    """Simulate ``steps`` steps at ``world_size`` ranks (see the module docstring).

    ``measured_s`` [N] seconds per sample; ``estimated_cost`` [N] the sampler's cost estimate of
    the same samples (any unit). Raises ``ValueError`` on mismatched or empty inputs."""
    from raggedvl.sampling import global_batches, plan_epoch

    t = np.asarray(measured_s, dtype=np.float64)
    c = np.asarray(estimated_cost, dtype=np.float64)
    if t.ndim != 1 or t.shape != c.shape or len(t) == 0:
        raise ValueError(f"measured_s and estimated_cost must be [N] arrays of equal length, got {t.shape}, {c.shape}")
    g = world_size * per_rank_batch
    reps = max(1, -(-4 * g // len(t)))
    t_v, c_v = np.tile(t, reps), np.tile(c, reps)
    eq_steps, rv_steps, bounds, eq_ratio, rv_ratio = [], [], [], [], []
    epoch = 0
    while len(eq_steps) < steps:
        batches = global_batches(c_v, g, world_size, seed=seed, epoch=epoch, drop_last=True)
        plan = plan_epoch(c_v, g, world_size, seed=seed, epoch=epoch, drop_last=True)
        if len(plan) != len(batches):
            raise ValueError(f"raggedvl's plan has {len(plan)} steps for {len(batches)} global batches")
        for batch, parts in zip(batches, plan):
            if sorted(batch.tolist()) != sorted(i for part in parts for i in part):
                raise ValueError("raggedvl's plan does not hold the same samples as the global batch")
            equal = np.array([t_v[chunk].sum() for chunk in np.array_split(batch, world_size)])
            ragged = np.array([t_v[part].sum() for part in parts])
            eq_steps.append(equal.max())
            rv_steps.append(ragged.max())
            bounds.append(max(equal.mean(), t_v[batch].max()))
            eq_ratio.append(equal.max() / equal.mean())
            rv_ratio.append(ragged.max() / ragged.mean())
            if len(eq_steps) == steps:
                break
        epoch += 1
    return SimRow(world_size, g, steps, float(np.mean(eq_steps)), float(np.mean(rv_steps)), float(np.mean(bounds)),
                  float(np.mean(eq_ratio)), float(np.mean(rv_ratio)))


def format_rows(rows: list[SimRow], source: str) -> str:
    lines = [
        f"Simulated step time from per-sample step costs ({source}); step = slowest rank.",
        "",
        "| W | global batch | steps | equal-count (colpali-engine) s/step | raggedvl plan s/step | bound s/step "
        "| samples/s raggedvl / colpali-engine | slowest/mean rank: equal | raggedvl |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.world_size} | {r.global_batch} | {r.steps} | {r.equal_step_s:.3f} | {r.raggedvl_step_s:.3f} | "
            f"{r.bound_step_s:.3f} | {r.speedup:.2f} | {r.equal_max_over_mean:.3f} | {r.raggedvl_max_over_mean:.3f} |"
        )
    return "\n".join(lines)

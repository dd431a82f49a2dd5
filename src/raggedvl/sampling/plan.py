"""One epoch's plan: which samples form each global step, and which rank gets which.

Pure function of (costs, patches, G, W, seed, epoch, options): every rank computes the same plan
with no communication. Shapes: N samples; ``costs`` [N] float64; ``patches`` [N] (same unit as
the cap); a plan is a list of S steps, each a list of W ascending lists of sample indices.

Policies (documented here, enforced and tested):
- Order: a permutation of 0..N-1 from ``numpy.random.Generator(PCG64(SeedSequence([seed,
  epoch])))``, identical on every machine and numpy version that keeps PCG64's stream; with a
  ``mixture`` (several datasets with weights), the mixture's seeded order of N draws instead
  (``raggedvl.sampling.mixture``).
- Global batches: consecutive runs of G samples of that permutation.
- One-source batches (a ``mixture`` with ``one_source``): global batch k draws one source and
  all its samples from it (``raggedvl.sampling.mixture``): ``min(G, rows of the source)``
  samples. The epoch has as many global batches as the remainder rule below gives the mixed
  order of the same N samples (so ``epochs`` means the same number of steps in both modes).
  Homogeneous steps are refused with it (their cost sort would mix sources across batches).
- Remainder (r = N mod G), ``drop_last=False``: if r >= W the r samples form one last, smaller
  step; if 0 < r < W they join the last full step (G + r samples), so every rank still gets at
  least one sample and every sample is used exactly once. ``drop_last=True`` drops the last r
  samples of the permutation (others next epoch); every step then has exactly G samples.
- Homogeneous steps (``homogeneous=True``): the permutation (less the remainder) is cut into
  pools of ``bucket_steps`` global batches; each pool is sorted by cost and re-cut into global
  batches of G, and the order of all full steps is shuffled (same seeded generator). Steps then
  hold samples of similar cost: a rank's share is near G/W samples of near-equal cost, so the
  per-step balance is at least as good, and same-kind images (spreads with spreads, crops with
  crops) meet as in-batch negatives: harder negatives on format, less diversity per step, and a
  step-to-step variation in step time (a step of spreads is slower than a step of crops).
- Patch cap (``max_patches_per_rank``): each step is partitioned so that every rank's summed
  patches stay <= the cap. A global batch that the packer cannot fit under W caps is split into
  the fewest consecutive chunks (k = 2, 3, ... up to size // W chunks, each of >= W samples)
  that fit; those steps carry fewer in-batch negatives, and every rank gets the same extra
  steps. If even the finest split does not fit, ``ValueError`` names the step and the sizes.
"""

from __future__ import annotations

import numpy as np

from raggedvl.sampling.mixture import Mixture
from raggedvl.sampling.partition import PartitionInfeasible, partition_costs


def epoch_permutation(num_samples: int, seed: int, epoch: int) -> np.ndarray:
    """[N] int64 permutation for (seed, epoch)."""
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(seed), int(epoch)])))
    return rng.permutation(num_samples)


def global_batches(
    costs: np.ndarray,
    global_batch_size: int,
    world_size: int,
    *,
    seed: int,
    epoch: int,
    drop_last: bool,
    homogeneous: bool = False,
    bucket_steps: int = 32,
    mixture: Mixture | None = None,
) -> list[np.ndarray]:
    """The epoch's global batches (arrays of sample indices), before partitioning.

    Raises ``ValueError`` for ``homogeneous`` with a one-source ``mixture``."""
    n, g = len(costs), global_batch_size
    if mixture is not None and mixture.one_source:
        if homogeneous:
            raise ValueError("homogeneous steps sort samples by cost across global batches, which would mix the "
                             "sources of one-source batches; use one of the two")
        rest = n % g
        count = n // g + (1 if rest and not drop_last and (rest >= world_size or n < g) else 0)
        return mixture.one_source_batches(seed, epoch, count, g)
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(seed), int(epoch), 1])))
    order = epoch_permutation(n, seed, epoch) if mixture is None else mixture.order(seed, epoch, g)
    full = (n // g) * g
    body, rest = order[:full], order[full:]
    if homogeneous and full:
        pools = [body[i : i + g * bucket_steps] for i in range(0, full, g * bucket_steps)]
        body = np.concatenate([p[np.argsort(costs[p], kind="stable")] for p in pools])
    batches = [body[i : i + g] for i in range(0, full, g)]
    if homogeneous and batches:
        batches = [batches[i] for i in rng.permutation(len(batches))]
    if drop_last or len(rest) == 0:
        return batches
    if len(rest) >= world_size or not batches:
        return batches + [rest]
    batches[-1] = np.concatenate([batches[-1], rest])
    return batches


def _partition_step(costs, patches, cap, world_size, batch, step) -> list[list[list[int]]]:
    """One global batch -> one or more steps (more only when the patch cap forces a split)."""
    c = costs[batch].tolist()
    s = patches[batch].tolist() if cap is not None else None
    for k in range(1, max(1, len(batch) // world_size) + 1):
        chunks = np.array_split(np.arange(len(batch)), k)
        try:
            steps = []
            for chunk in chunks:
                parts = partition_costs(
                    [c[i] for i in chunk], world_size,
                    sizes=None if s is None else [s[i] for i in chunk], capacity=cap,
                )
                steps.append([[int(batch[chunk[i]]) for i in part] for part in parts])
            return [[sorted(part) for part in step] for step in steps]
        except PartitionInfeasible:
            continue
    raise ValueError(
        f"global batch {step} ({len(batch)} samples, patches {sorted(s, reverse=True)[:8]}..., "
        f"total {sum(s):g}) cannot be packed under {world_size} ranks x {cap:g} patches even when "
        f"split into steps of {world_size} samples; raise max_patches_per_rank or lower max_pixels"
    )


def plan_epoch(
    costs: np.ndarray,
    global_batch_size: int,
    world_size: int,
    *,
    seed: int,
    epoch: int,
    drop_last: bool,
    patches: np.ndarray | None = None,
    max_patches_per_rank: float | None = None,
    homogeneous: bool = False,
    bucket_steps: int = 32,
    mixture: Mixture | None = None,
) -> list[list[list[int]]]:
    """The epoch's steps: [S][W] ascending lists of sample indices (see the module policies)."""
    plan: list[list[list[int]]] = []
    batches = global_batches(
        costs, global_batch_size, world_size, seed=seed, epoch=epoch, drop_last=drop_last,
        homogeneous=homogeneous, bucket_steps=bucket_steps, mixture=mixture,
    )
    for step, batch in enumerate(batches):
        plan.extend(_partition_step(costs, patches, max_patches_per_rank, world_size, batch, step))
    return plan

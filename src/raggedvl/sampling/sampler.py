"""Cost-balanced distributed batch sampler: no straggler rank, exact resume, no communication.

Each step draws a global batch of G samples from a seeded permutation of (seed, epoch) and
partitions it across the W ranks so that the most expensive rank's summed cost is as low as the
partitioner can make it (``raggedvl.sampling.partition``). Per-rank sample counts differ from
step to step (the distributed losses gather ragged counts); every rank gets at least one sample
per step and every rank takes the same number of steps. All ranks compute the same plan from
the same inputs, so nothing is exchanged. Remainder, homogeneous-step and patch-cap policies:
``raggedvl.sampling.plan``.

Shapes: N samples; ``costs`` [N] (any non-negative unit, e.g. ``estimate_costs(...).costs``);
``patches`` [N] vision rows per sample (the memory proxy the cap counts).
"""

from __future__ import annotations

import hashlib
from typing import Any, Iterator, Sequence

import numpy as np

from raggedvl.sampling.mixture import Mixture
from raggedvl.sampling.plan import plan_epoch

_STATE_VERSION = 1


class SamplerPositionError(ValueError):
    """A saved sampler position has no equivalent in this sampler's plan for another world size."""


def _as_array(name: str, values: Sequence[float], n: int | None = None) -> np.ndarray:
    arr = np.asarray(values, dtype=np.float64)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be one value per sample (1-D), got shape {arr.shape}")
    if n is not None and len(arr) != n:
        raise ValueError(f"{name} has {len(arr)} entries but costs has {n}; give one per sample")
    bad = np.flatnonzero(~np.isfinite(arr) | (arr < 0))
    if len(bad):
        i = int(bad[0])
        raise ValueError(f"sample {i} has {name} {float(arr[i])!r}; {name} must be finite and >= 0")
    return arr


class BalancedDistributedBatchSampler:
    """Yields this rank's list of dataset indices for each step (use as ``batch_sampler``).

    Args:
        costs: [N] per-sample cost, non-negative.
        global_batch_size: G, samples per step over all ranks (the in-batch negative pool);
            ``G >= world_size`` so every rank gets a sample.
        world_size, rank: W and this rank, plain integers (read the environment at the edge).
        seed: permutation seed; the plan is a pure function of (seed, epoch, costs, options).
        drop_last: drop the N mod G remainder (default False: keep it, see ``plan``).
        max_patches_per_rank: optional cap on each rank's summed ``patches`` per step.
        patches: [N] per-sample patch counts; required with ``max_patches_per_rank``.
        homogeneous: group samples of similar cost into the same step (``plan`` explains the
            effect on balance and negatives); ``bucket_steps`` global batches form one pool.
        mixture: several datasets (sources) concatenated in ``costs``' order, drawn with weights
            (:class:`raggedvl.sampling.mixture.Mixture`; its sizes must sum to N): each epoch's
            order is the mixture's seeded draws instead of a permutation; with
            ``mixture.one_source`` each global batch is drawn from one source
            (:meth:`step_source` names it). Part of the resume fingerprint.
        indices: [N] distinct dataset indices, the row each sample stands for (default
            ``0..N-1``): rows left out of training (the size estimate rejected their images) are
            absent, so every step draws only rows in it; the plan and the yielded lists hold these
            indices. A mixture's sizes then count each source's rows in ``indices``, which list the
            sources' rows source after source (not ascending when a source's rows are spread over
            the dataset). Part of the resume fingerprint (``rows_sha256``; None without
            ``indices``, as in older states).

    ``len()`` is the number of steps of the current epoch (constant unless the cap splits a
    step). The whole epoch is planned at its first ``len()``/iteration (about 1 ms of CPU per
    step at G=256, W=64; a patch cap that no split can meet raises ``ValueError`` there, before
    any training step). After ``load_state_dict`` the next iteration resumes at the saved step;
    a full iteration resets to the epoch's start, so iterating again repeats the epoch.

    Use: ``DataLoader(dataset, batch_sampler=sampler, collate_fn=...)``, ``sampler.set_epoch(e)``
    before each epoch, ``sampler.state_dict(step=steps_done_this_epoch)`` in checkpoints.

    Raises ``ValueError`` (before any work, naming the sample and the fix) for: W < 1, rank not
    in [0, W), G < W, N < W, N < G with ``drop_last``, a negative or non-finite cost or patch
    count, a cap without ``patches``, one sample whose patches exceed the cap, ``indices`` not
    N distinct non-negative integers, or one-source batches with a drawn source of fewer than W
    rows or with ``homogeneous``.
    """

    def __init__(
        self,
        costs: Sequence[float],
        global_batch_size: int,
        world_size: int,
        rank: int,
        seed: int = 0,
        drop_last: bool = False,
        max_patches_per_rank: float | None = None,
        patches: Sequence[float] | None = None,
        homogeneous: bool = False,
        bucket_steps: int = 32,
        mixture: Mixture | None = None,
        indices: Sequence[int] | None = None,
    ) -> None:
        self.costs = _as_array("cost", costs)
        n = len(self.costs)
        self.indices = None
        if indices is not None:
            rows = np.asarray(indices, dtype=np.int64).reshape(-1)
            if len(rows) != n:
                raise ValueError(f"indices has {len(rows)} entries but costs has {n}; give one dataset index per sample")
            if n and (rows.min() < 0 or len(np.unique(rows)) != n):
                raise ValueError("indices must be distinct dataset indices >= 0 (the rows kept)")
            self.indices = rows
        if mixture is not None and mixture.num_samples != n:
            raise ValueError(f"the mixture's datasets hold {mixture.num_samples} rows {list(mixture.sizes)} but costs "
                             f"has {n}; give one cost per row of the concatenated datasets")
        self.mixture = mixture
        if mixture is not None and mixture.one_source:
            if homogeneous:
                raise ValueError("homogeneous steps sort samples by cost across global batches, which would mix the "
                                 "sources of one-source batches; use one of the two")
            for d, (size, weight) in enumerate(zip(mixture.sizes, mixture.weights)):
                if weight > 0 and size < world_size:
                    raise ValueError(
                        f"source {mixture.name(d)} has {size} rows, fewer than the {world_size} ranks: a one-source "
                        f"step drawn from it would leave a rank without a sample; give it weight 0, more rows, or "
                        f"use fewer processes")
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, {world_size}); pass the process's global rank")
        if global_batch_size < world_size:
            raise ValueError(
                f"global_batch_size {global_batch_size} < world_size {world_size}: some rank would get no "
                f"sample; use a global batch of at least {world_size}"
            )
        if n < world_size:
            raise ValueError(f"only {n} samples for {world_size} ranks; every rank needs at least one per step")
        if drop_last and n < global_batch_size:
            raise ValueError(
                f"{n} samples < global_batch_size {global_batch_size} with drop_last=True leaves no step; "
                f"use drop_last=False or a smaller global batch"
            )
        if bucket_steps < 1:
            raise ValueError(f"bucket_steps must be >= 1, got {bucket_steps}")
        self.patches = None
        if max_patches_per_rank is not None:
            if patches is None:
                raise ValueError("max_patches_per_rank needs patches= (one patch count per sample)")
            self.patches = _as_array("patches", patches, n)
            over = np.flatnonzero(self.patches > max_patches_per_rank)
            if len(over):
                i = int(over[0])
                raise ValueError(
                    f"sample {i} has {self.patches[i]:g} patches > max_patches_per_rank {max_patches_per_rank:g} "
                    f"({len(over)} samples exceed it): no rank can hold it; raise the cap or lower max_pixels"
                )
        self.global_batch_size = int(global_batch_size)
        self.world_size = int(world_size)
        self.rank = int(rank)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.max_patches_per_rank = max_patches_per_rank
        self.homogeneous = bool(homogeneous)
        self.bucket_steps = int(bucket_steps)
        self.epoch = 0
        self._start_step = 0
        self._next_step = 0
        self._plan: list[list[list[int]]] | None = None
        self._sources: list[int] | None = None  # the source of each step of the plan (one-source batches)
        self._plan_epoch = -1

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch's permutation. Setting the epoch a resumed state points at keeps the
        resume step; any other epoch starts at step 0."""
        if int(epoch) != self.epoch:
            self._start_step = 0
        self.epoch = int(epoch)

    def _plan_for(self, world_size: int) -> list[list[list[int]]]:
        """The current epoch's plan for ``world_size`` ranks: [S][W] lists of positions."""
        return plan_epoch(
            self.costs, self.global_batch_size, world_size, seed=self.seed, epoch=self.epoch,
            drop_last=self.drop_last, patches=self.patches, max_patches_per_rank=self.max_patches_per_rank,
            homogeneous=self.homogeneous, bucket_steps=self.bucket_steps, mixture=self.mixture,
        )

    def plan(self) -> list[list[list[int]]]:
        """The current epoch's steps for all ranks: [S][W] ascending lists of dataset indices
        (through ``indices`` when given) (cached)."""
        if self._plan_epoch != self.epoch:
            plan = self._plan_for(self.world_size)
            if self.mixture is not None and self.mixture.one_source:  # every sample of a step has its source
                self._sources = [self.mixture.source_of(step[0][0]) for step in plan]
            if self.indices is not None:  # positions -> dataset rows, ascending within each rank's list
                rows = self.indices.tolist()
                plan = [[sorted(rows[i] for i in part) for part in step] for step in plan]
            self._plan = plan
            self._plan_epoch = self.epoch
        return self._plan

    @property
    def source_names(self) -> tuple[str, ...]:
        """The mixture's source names (empty without a mixture)."""
        return () if self.mixture is None else tuple(self.mixture.name(d) for d in range(len(self.mixture.sizes)))

    def step_source(self, step: int) -> str | None:
        """The name of the source every sample of step ``step`` (0-based) of the current epoch
        comes from under one-source batches; None otherwise."""
        self.plan()
        return None if self._sources is None else self.mixture.name(self._sources[step])

    def __len__(self) -> int:
        return len(self.plan())

    def __iter__(self) -> Iterator[list[int]]:
        plan = self.plan()
        start, self._start_step = self._start_step, 0
        self._next_step = start
        for step in range(start, len(plan)):
            self._next_step = step + 1
            yield list(plan[step][self.rank])

    def _fingerprint(self) -> dict[str, Any]:
        digest = hashlib.sha256(self.costs.tobytes())
        if self.patches is not None:
            digest.update(self.patches.tobytes())
        return {
            "num_samples": len(self.costs),
            "global_batch_size": self.global_batch_size,
            "world_size": self.world_size,
            "seed": self.seed,
            "drop_last": self.drop_last,
            "max_patches_per_rank": self.max_patches_per_rank,
            "homogeneous": self.homogeneous,
            "bucket_steps": self.bucket_steps,
            "costs_sha256": digest.hexdigest()[:16],
            "mixture": None if self.mixture is None else self.mixture.state(),
            "rows_sha256": None if self.indices is None else hashlib.sha256(self.indices.tobytes()).hexdigest()[:16],
        }

    def state_dict(self, step: int | None = None) -> dict[str, Any]:
        """Plain JSON-serialisable resume point. ``step`` = steps of this epoch already consumed;
        by default the number this sampler has yielded. Pass the trainer's own count when a
        DataLoader prefetches batches ahead of the optimizer step."""
        done = self._next_step if step is None else int(step)
        return {"version": _STATE_VERSION, "epoch": self.epoch, "step": done, **self._fingerprint()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the next iteration yields exactly the samples after those of ``state['step']``
        steps. A state saved with another world size W' continues at the step of this plan that
        has consumed the same samples: the global batches do not depend on W (``plan_epoch``),
        so the rest of the epoch trains the same global batches, partitioned over this W.

        Raises ``ValueError`` listing every field other than W that differs from this sampler's
        settings (a different dataset, G, seed or option would silently change the plan), and
        :class:`SamplerPositionError` when the W' plan's first steps end inside one of this
        plan's steps (a global batch the patch cap splits differently for the two W)."""
        mine = self._fingerprint()
        diff = [f"{k}: saved {state.get(k)!r}, now {v!r}" for k, v in mine.items()
                if state.get(k) != v and k != "world_size"]
        if state.get("version") != _STATE_VERSION:
            diff.append(f"version: saved {state.get('version')!r}, now {_STATE_VERSION}")
        if diff:
            raise ValueError("sampler state does not match this sampler: " + "; ".join(diff))
        self.epoch = int(state["epoch"])
        saved_world = int(state.get("world_size", self.world_size))
        steps = len(self._plan_for(saved_world)) if saved_world != self.world_size else len(self.plan())
        if not 0 <= int(state["step"]) <= steps:
            raise ValueError(f"saved step {state['step']} is outside epoch {self.epoch}'s 0..{steps} steps")
        self._start_step = int(state["step"])
        if saved_world != self.world_size:
            self._start_step = self._same_samples_step(saved_world, self._start_step)
        self._next_step = self._start_step

    def _same_samples_step(self, saved_world: int, saved_step: int) -> int:
        """The step of this plan after which exactly the samples of the first ``saved_step`` steps
        of the ``saved_world``-rank plan are consumed."""
        done = {i for step in self._plan_for(saved_world)[:saved_step] for part in step for i in part}
        seen: set[int] = set()
        for k, step in enumerate(self._plan_for(self.world_size)):
            if seen == done:
                return k
            seen.update(i for part in step for i in part)
        if seen == done:
            return len(self._plan_for(self.world_size))
        raise SamplerPositionError(
            f"step {saved_step} of epoch {self.epoch} with {saved_world} ranks ends inside a step of the plan for "
            f"{self.world_size} ranks (the patch cap splits a global batch differently for the two); resume with "
            f"{saved_world} processes, or with a --max-patches-per-rank that splits no global batch")

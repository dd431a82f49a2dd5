"""The learning-rate schedule of ``raggedvl train``, and how a resumed run with another total
number of steps continues it.

The schedule is transformers' ``get_cosine_schedule_with_warmup`` /
``get_linear_schedule_with_warmup`` (the HF Trainer's): a linear warmup from 0 over ``warmup``
steps, then a decay to 0 at the last step, as a function of the decay's progress (0 at the end of
the warmup, 1 at the last step). :class:`LrFactor` computes it with transformers' float
operations (a fresh run's rates are identical to transformers'), and holds the progress as a
piecewise-linear function of the step, given by knots ``[step, progress]``: a fresh run has two,
``[warmup, 0]`` and ``[total, 1]``.

A run resumed with another total (``--max-steps``, or ``--epochs``) keeps the steps it trained
and the warmup, and stretches the rest of the decay over the new remaining steps: one knot at the
last trained step (its progress as trained), then ``[new total, 1]``. The rate never jumps: the
first resumed step runs just below the last trained step's rate, and the rate reaches 0 at the
new last step; a longer run decays more slowly, a shorter one faster. ``LambdaLR`` saves a
callable object's attributes in its state, so the knots travel in every checkpoint and a run
resumed again continues the stretched schedule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from raggedvl.app.config import TrainConfig
from raggedvl.app.wording import counted


@dataclass
class LrFactor:
    """The learning rate of a 0-based optimizer step as a fraction of the peak rate.

    ``kind``: ``"cosine"`` or ``"linear"``; ``warmup``: steps of the linear warmup (step ``s <
    warmup`` runs at ``s / warmup``); ``knots``: ``[step, progress]`` pairs with increasing steps,
    the first at ``warmup`` with progress 0, the last at the run's total with progress 1."""

    kind: str
    warmup: int
    knots: list[list[float]]

    def progress(self, step: int) -> float:
        """The decay's progress at ``step`` (``>= warmup``): linear between the knots around it
        (the last segment for steps past it)."""
        segments = list(zip(self.knots, self.knots[1:]))
        (s0, p0), (s1, p1) = next((seg for seg in segments if step < seg[1][0]), segments[-1])
        return p0 + (p1 - p0) * (float(step - s0) / float(max(1, s1 - s0)))

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return float(step) / float(max(1, self.warmup))
        (s0, p0), (total, _) = self.knots[-2], self.knots[-1]
        if self.kind == "linear" and step >= s0:  # transformers' expression: (total - step) / (total - warmup)
            return max(0.0, (1.0 - p0) * float(total - step) / float(max(1, total - s0)))
        progress = self.progress(step)
        if self.kind == "linear":
            return max(0.0, 1.0 - progress)
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))

    def continued(self, step: int, total_steps: int) -> "LrFactor":
        """This schedule for a run that has trained ``step`` steps and continues to
        ``total_steps``: the same rates up to the last trained step (or the warmup's end, when
        later), then the rest of the decay stretched to end at ``total_steps``."""
        anchor = max(step - 1, self.warmup)
        kept = [list(k) for k in self.knots if k[0] < anchor]
        return LrFactor(self.kind, self.warmup, [*kept, [anchor, self.progress(anchor)], [total_steps, 1.0]])


def make_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """``cfg.lr_schedule``'s schedule (module docstring) over ``total_steps`` with
    ``cfg.resolved_warmup_steps(total_steps)`` warmup steps, one :class:`LrFactor` per parameter
    group (the first step runs at lr 0 with any warmup, as in transformers)."""
    warmup = cfg.resolved_warmup_steps(total_steps)
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, [LrFactor(cfg.lr_schedule, warmup, [[warmup, 0.0], [total_steps, 1.0]])
                    for _ in optimizer.param_groups])


def load_scheduler_state(scheduler: torch.optim.lr_scheduler.LambdaLR, state: dict[str, Any]) -> str | None:
    """Restore a checkpoint's ``state`` (step count, base rates, the schedule's knots) into
    ``scheduler`` built by :func:`make_scheduler` for this run's total steps, and set every
    parameter group's learning rate to the schedule's value at the restored step (the optimizer
    state holds the one the checkpoint's schedule gave). When the checkpoint's schedule ends at
    another total, it is continued (:meth:`LrFactor.continued`) and the one line saying so is
    returned, else None. A checkpoint of an older raggedvl, without knots, follows this run's
    schedule from the restored step."""
    total = scheduler.lr_lambdas[0].knots[-1][0]
    scheduler.load_state_dict(state)
    planned = scheduler.lr_lambdas[0].knots[-1][0]
    step = scheduler.last_epoch
    note = None
    if planned != total:
        last = scheduler.lr_lambdas[0](step - 1)
        scheduler.lr_lambdas = [fn.continued(step, total) for fn in scheduler.lr_lambdas]
        fn = scheduler.lr_lambdas[0]
        head = f"the learning-rate schedule planned {planned} steps and continues to {total}"
        note = (f"{head}, within its warmup ({counted(fn.warmup, 'step')}): the rate rises to the last step, with no "
                "decay" if total <= fn.warmup else
                f"{head}: the warmup ({counted(fn.warmup, 'step')}) as trained, then the {fn.kind} decay from step "
                f"{step}'s rate ({100 * last:.3g} % of the peak) stretched to reach 0 at step {total}")
    rates = [base * fn(step) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, rate in zip(scheduler.optimizer.param_groups, rates):
        group["lr"] = rate
    scheduler._last_lr = rates
    return note

"""Learning-rate schedule: linear warmup then cosine decay to zero (Loshchilov & Hutter, 2017,
"SGDR"; the warmup + cosine shape used by ColPali's and most contrastive training recipes)."""

from __future__ import annotations

import math

import torch


def warmup_cosine(optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Multiplier ``(s+1)/warmup`` for the first ``warmup_steps`` steps, then
    ``0.5 * (1 + cos(pi * progress))`` down to 0 at ``total_steps``.

    Raises ``ValueError`` if ``total_steps < 1`` or ``warmup_steps < 0``."""
    if total_steps < 1 or warmup_steps < 0:
        raise ValueError(f"need total_steps >= 1 and warmup_steps >= 0, got {total_steps}, {warmup_steps}")
    warmup = min(warmup_steps, max(0, total_steps - 1))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total_steps - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)

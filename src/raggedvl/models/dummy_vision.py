"""Dummy vision pass: every forward calls the vision tower once per expected modality.

Why (issue 7 item 1, case C04): under DDP without ``find_unused_parameters`` a rank whose batch
has no image never uses the vision tower's parameters, its reducer waits for gradients that
never come, and the next iteration fails with "Expected to have finished reduction in the prior
iteration" (or hangs); FSDP2 / ZeRO-3 deadlock when ranks call the tower a different number of
times (images and videos on one rank, images only on another).

Fix: for each modality in ``expected`` ("image", "video") that the batch lacks, run the smallest
valid input, one ``[t, h, w] = [1, 2, 2]`` grid (4 patch rows of zeros, one merged visual
token), through the tower and return ``0.0 * sum(outputs)``; the caller adds that scalar to the
language model's hidden states. Properties:

- value: ``x + 0.0 * s == x`` exactly for finite ``x`` (zero input keeps ``s`` finite), so the
  loss is bit-identical;
- gradient: every vision parameter receives a gradient of exactly zero (a tensor, not ``None``),
  so DDP's reducer sees every parameter used on every rank and all-reduces zeros;
- call count: one tower call per expected modality on every rank, real or dummy, so sharded
  wrappers issue the same collectives everywhere;
- Qwen3-VL: its deepstack features (one per deepstack layer) are summed into the term too, so
  the deepstack mergers also receive zero gradients.

Works with gradient checkpointing (the tower's blocks checkpoint the dummy like any input).
Shapes: pixel rows [4, patch_dim], grid [1, 3]; patch_dim = 3 * temporal_patch * patch**2.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

MODALITY_KEYS = {"image": "pixel_values", "video": "pixel_values_videos"}


def dummy_vision_inputs(visual: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero pixel rows ``[4, patch_dim]`` and grid ``[[1, 2, 2]]`` in the tower's dtype/device."""
    cfg = visual.config
    patch = cfg.patch_size if isinstance(cfg.patch_size, int) else cfg.patch_size[0]
    temporal = cfg.temporal_patch_size if isinstance(cfg.temporal_patch_size, int) else cfg.temporal_patch_size[0]
    merge = cfg.spatial_merge_size
    param = next(visual.parameters())
    rows = merge * merge
    pixels = torch.zeros(rows, cfg.in_channels * temporal * patch * patch, dtype=param.dtype, device=param.device)
    grid = torch.tensor([[1, merge, merge]], dtype=torch.long, device=param.device)
    return pixels, grid


def missing_modalities(batch: dict, expected: Iterable[str]) -> list[str]:
    """Modalities of ``expected`` whose pixel tensor is absent (or has zero rows) in ``batch``."""
    missing = []
    for modality in expected:
        if modality not in MODALITY_KEYS:
            raise ValueError(f"unknown vision modality {modality!r}; expected a subset of {sorted(MODALITY_KEYS)}")
        pixels = batch.get(MODALITY_KEYS[modality])
        if pixels is None or pixels.shape[0] == 0:
            missing.append(modality)
    return missing


def dummy_vision_term(visual: nn.Module, count: int = 1) -> torch.Tensor | None:
    """``0.0 * sum(tower outputs)`` for ``count`` dummy tower calls; ``None`` when ``count`` is 0.

    The result is a scalar with ``requires_grad`` when the tower has trainable parameters;
    adding it to any tensor changes neither values nor gradients (module docstring).
    """
    term = None
    for _ in range(count):
        pixels, grid = dummy_vision_inputs(visual)
        out = visual(pixels, grid_thw=grid)
        total = out.pooler_output.float().sum()
        for feature in getattr(out, "deepstack_features", None) or ():
            total = total + feature.float().sum()
        term = total * 0.0 if term is None else term + total * 0.0
    return term

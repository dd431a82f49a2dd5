"""Per-sample compute cost model for dynamic-resolution VLM batches.

cost(sample) = per_sample
             + per_patch * sum_i P_i                      (vision MLPs: linear in patches)
             + per_patch_pair * sum_i P_i**2              (vision attention: quadratic per image)
             + per_token * L                              (language model: linear in tokens)

where P_i = t*h*w is image i's patch count (rows of ``pixel_values``) and L the sample's
sequence length in tokens (text plus visual placeholder tokens). Units are relative unless the
coefficients were calibrated by timing (``raggedvl.sampling.calibrate``), in which case they are
seconds. The model is linear in its four coefficients: ``cost = features @ coefficients`` with
the feature columns ``FEATURES``.

Shapes: B samples, I images (all samples together); ``grid_thw`` [I, 3] int (t, h, w in
patches); ``image_counts`` list of B ints (images owned by each sample, in order);
``seq_lens`` [B]; features [B, 4] float64; costs [B] float64.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

FEATURES = ("per_sample", "per_patch", "per_patch_pair", "per_token")


def cost_features(
    grid_thw: torch.Tensor, image_counts: Sequence[int], seq_lens: torch.Tensor
) -> torch.Tensor:
    """Feature matrix [B, 4] float64 with columns (1, sum_i P_i, sum_i P_i**2, L).

    Raises ``ValueError`` if ``image_counts`` does not sum to the number of grid rows or its
    length differs from ``seq_lens``.
    """
    counts = [int(k) for k in image_counts]
    if sum(counts) != grid_thw.shape[0]:
        raise ValueError(
            f"image_counts sum to {sum(counts)} but grid_thw has {grid_thw.shape[0]} rows; "
            f"give one grid per image, in sample order"
        )
    if len(counts) != seq_lens.shape[0]:
        raise ValueError(f"image_counts has {len(counts)} samples but seq_lens has {seq_lens.shape[0]}")
    patches = grid_thw.to(torch.float64).prod(dim=-1) if grid_thw.numel() else torch.zeros(0, dtype=torch.float64)
    owner = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts, dtype=torch.long))
    feats = torch.zeros(len(counts), 4, dtype=torch.float64)
    feats[:, 0] = 1.0
    feats[:, 1].index_add_(0, owner, patches)
    feats[:, 2].index_add_(0, owner, patches * patches)
    feats[:, 3] = seq_lens.to(torch.float64)
    return feats


@dataclass(frozen=True)
class CostModel:
    """Linear per-sample cost model; coefficients must be finite and >= 0 (``ValueError``)."""

    per_sample: float = 0.0
    per_patch: float = 1.0
    per_patch_pair: float = 1.0 / 8192.0
    per_token: float = 1.0

    def __post_init__(self) -> None:
        for name in FEATURES:
            value = getattr(self, name)
            if not (value >= 0.0) or value == float("inf"):
                raise ValueError(f"CostModel.{name} = {value!r}; coefficients must be finite and >= 0")

    @property
    def coefficients(self) -> torch.Tensor:
        """[4] float64 in the order of ``FEATURES``."""
        return torch.tensor([getattr(self, name) for name in FEATURES], dtype=torch.float64)

    @classmethod
    def from_coefficients(cls, coefficients: Sequence[float]) -> "CostModel":
        """Inverse of ``coefficients``; ``ValueError`` unless exactly 4 values are given."""
        values = [float(v) for v in coefficients]
        if len(values) != len(FEATURES):
            raise ValueError(f"expected {len(FEATURES)} coefficients {FEATURES}, got {len(values)}")
        return cls(**dict(zip(FEATURES, values)))

    def image_costs(self, grid_thw: torch.Tensor) -> torch.Tensor:
        """``grid_thw`` [n_images, 3] (t, h, w in patches) -> [n_images] float64 vision cost."""
        patches = grid_thw.to(torch.float64).prod(dim=-1) if grid_thw.numel() else grid_thw.new_zeros(0, dtype=torch.float64)
        return self.per_patch * patches + self.per_patch_pair * patches * patches

    def sample_costs(
        self, grid_thw: torch.Tensor, image_counts: list[int], seq_lens: torch.Tensor
    ) -> torch.Tensor:
        """Per-sample cost [B] float64 from per-image grids, ownership counts and [B] lengths."""
        return self.costs_from_features(cost_features(grid_thw, image_counts, seq_lens))

    def costs_from_features(self, features: torch.Tensor) -> torch.Tensor:
        """``features`` [B, 4] (see ``cost_features``) -> [B] float64 costs."""
        return features.to(torch.float64) @ self.coefficients

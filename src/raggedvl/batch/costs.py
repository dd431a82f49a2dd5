"""Per-sample compute cost model for dynamic-resolution VLM batches.

cost(sample) = per_sample
             + per_patch * sum_i P_i                      (vision MLPs: linear in patches)
             + per_patch_pair * sum_i P_i**2              (vision attention: quadratic per image)
             + per_token * L                              (language model: linear in tokens)

where P_i = t*h*w is image i's patch count (rows of ``pixel_values``) and L the sample's
sequence length in tokens (text plus visual placeholder tokens). Units are relative unless the
coefficients were calibrated by timing, in which case they are seconds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CostModel:
    per_sample: float = 0.0
    per_patch: float = 1.0
    per_patch_pair: float = 1.0 / 8192.0
    per_token: float = 1.0

    def image_costs(self, grid_thw: torch.Tensor) -> torch.Tensor:
        """``grid_thw`` [n_images, 3] (t, h, w in patches) -> [n_images] float64 vision cost."""
        patches = grid_thw.to(torch.float64).prod(dim=-1) if grid_thw.numel() else grid_thw.new_zeros(0, dtype=torch.float64)
        return self.per_patch * patches + self.per_patch_pair * patches * patches

    def sample_costs(
        self, grid_thw: torch.Tensor, image_counts: list[int], seq_lens: torch.Tensor
    ) -> torch.Tensor:
        """Per-sample cost [B] float64 from per-image grids, ownership counts and [B] lengths."""
        img = self.image_costs(grid_thw)
        owner = torch.repeat_interleave(torch.arange(len(image_counts)), torch.tensor(image_counts, dtype=torch.long))
        vision = torch.zeros(len(image_counts), dtype=torch.float64).index_add_(0, owner, img)
        return self.per_sample + vision + self.per_token * seq_lens.to(torch.float64)

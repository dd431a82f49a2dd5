"""Flat <-> padded patch layouts, for interop with the pad-every-image convention.

colpali-engine's ColQwen2 processor and transformers' ColQwen2 pad each image's patch rows to the
batch's largest image, giving ``pixel_values`` [N, P_max, D_p], and cut the padding off again
inside the model using the grid products. ``pad_patches`` builds that layout from the flat one,
``unpad_patches`` is its exact inverse; both are single scatter/gather ops (no per-image loop).

Shape legend: N items, P = sum(patch_counts) flat patch rows, P_max = max(patch_counts),
D_p patch_dim.
"""

from __future__ import annotations

import torch

from .offsets import exclusive_cumsum


def ranges(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Concatenation of ``arange(starts[i], starts[i] + lengths[i])`` over i, as int64 [sum(lengths)]."""
    lengths = lengths.to(torch.int64)
    total = int(lengths.sum()) if lengths.numel() else 0
    if total == 0:
        return torch.zeros(0, dtype=torch.int64)
    offsets = exclusive_cumsum(lengths)
    return torch.repeat_interleave(starts.to(torch.int64) - offsets, lengths) + torch.arange(total)


def _padded_rows(patch_counts: torch.Tensor, max_patches: int) -> torch.Tensor:
    """Row index into the flattened [N * P_max] padded tensor of every flat patch row."""
    starts = torch.arange(patch_counts.numel(), dtype=torch.int64) * max_patches
    return ranges(starts, patch_counts)


def pad_patches(patches: torch.Tensor, patch_counts: torch.Tensor) -> torch.Tensor:
    """Flat ``patches`` [P, D_p] -> zero-padded [N, P_max, D_p] (item i in row i, its first
    ``patch_counts[i]`` rows valid). Raises ``ValueError`` if P != sum(patch_counts)."""
    total = int(patch_counts.sum())
    if patches.shape[0] != total:
        raise ValueError(f"{patches.shape[0]} patch rows but the grid products sum to {total}")
    n = patch_counts.numel()
    max_patches = int(patch_counts.max()) if n else 0
    out = patches.new_zeros(n * max_patches, patches.shape[-1])
    out[_padded_rows(patch_counts, max_patches)] = patches
    return out.view(n, max_patches, patches.shape[-1])


def unpad_patches(padded: torch.Tensor, patch_counts: torch.Tensor) -> torch.Tensor:
    """Padded [N, P_max, D_p] -> flat [P, D_p], keeping the first ``patch_counts[i]`` rows of item i.

    Raises ``ValueError`` if N differs from the number of grids or an item's patch count exceeds P_max.
    """
    if padded.dim() != 3:
        raise ValueError(f"padded patches must be [N, P_max, D_p], got shape {list(padded.shape)}")
    n, max_patches, dim = padded.shape
    if n != patch_counts.numel():
        raise ValueError(f"padded patches hold {n} items but there are {patch_counts.numel()} grid rows")
    if n and int(patch_counts.max()) > max_patches:
        i = int(patch_counts.argmax())
        raise ValueError(
            f"item {i} needs {int(patch_counts[i])} patch rows but the padded tensor has only {max_patches}; "
            "the grids do not belong to these pixel values"
        )
    return padded.reshape(n * max_patches, dim)[_padded_rows(patch_counts, max_patches)]

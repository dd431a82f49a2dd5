"""Per-sample costs from image sizes, without decoding a pixel.

An image of (width, height) pixels becomes, under the Qwen2-VL processor's resize rule
(transformers' ``smart_resize``: both sides rounded to multiples of ``patch_size * merge_size``
with the pixel count kept within [min_pixels, max_pixels] at the original aspect ratio), a grid
(t=1, h, w) in patches: P = h*w rows of ``pixel_values`` and P / merge_size**2 placeholder
tokens in the text. ``estimate_costs`` turns the grids and a text length into per-sample costs
with ``raggedvl.batch.costs.CostModel``, plus per-sample patch counts (the memory proxy that
``BalancedDistributedBatchSampler(max_patches_per_rank=...)`` caps).

Shapes: N samples; ``image_sizes`` N entries, each None (text only), one (width, height) or a
list of them (several images); ``text_tokens`` an int or N ints; outputs [N] arrays.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Sequence

import numpy as np
import torch

from raggedvl.batch.costs import CostModel, cost_features

# <|vision_start|> and <|vision_end|> around every image's placeholder tokens.
IMAGE_MARKER_TOKENS = 2


@lru_cache(maxsize=1)
def _smart_resize():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    return smart_resize


@dataclass(frozen=True)
class ResizeRule:
    """The processor's resize rule. Defaults are transformers 5.x ``Qwen2VLImageProcessor``'s
    (patch 14, merge 2, min_pixels 56*56, max_pixels 28*28*1280)."""

    patch_size: int = 14
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280

    @classmethod
    def from_processor(cls, processor: Any) -> "ResizeRule":
        """Read the rule from a ``Qwen2VLProcessor`` or its image processor (``size`` holds
        ``shortest_edge`` = min_pixels and ``longest_edge`` = max_pixels in transformers 5)."""
        ip = getattr(processor, "image_processor", processor)
        size = getattr(ip, "size", None) or {}
        get = size.get if isinstance(size, dict) else lambda k, d=None: getattr(size, k, d)
        return cls(
            patch_size=int(ip.patch_size),
            merge_size=int(ip.merge_size),
            min_pixels=int(get("shortest_edge", None) or getattr(ip, "min_pixels", cls.min_pixels)),
            max_pixels=int(get("longest_edge", None) or getattr(ip, "max_pixels", cls.max_pixels)),
        )

    def grid(self, width: int, height: int) -> tuple[int, int, int]:
        """(t, h, w) in patches for one image of ``width`` x ``height`` pixels.

        Raises ``ValueError`` for a non-positive side or an aspect ratio above 200 (the
        processor's own limit)."""
        if width < 1 or height < 1:
            raise ValueError(f"image size ({width}, {height}) must be positive (width, height) pixels")
        h, w = _smart_resize()(
            int(height),
            int(width),
            factor=self.patch_size * self.merge_size,
            min_pixels=self.min_pixels,
            max_pixels=self.max_pixels,
        )
        return 1, h // self.patch_size, w // self.patch_size


@dataclass(frozen=True)
class SampleCosts:
    """``costs`` [N] float64 (cost-model units), ``patches`` [N] int64 (vision rows),
    ``seq_lens`` [N] int64 (text + markers + placeholder tokens), ``features`` [N, 4]."""

    costs: np.ndarray
    patches: np.ndarray
    seq_lens: np.ndarray
    features: np.ndarray


def _as_size_list(entry: Any, sample: int) -> list[tuple[int, int]]:
    if entry is None:
        return []
    if len(entry) == 2 and all(isinstance(v, (int, np.integer)) for v in entry):
        return [(int(entry[0]), int(entry[1]))]
    sizes = [tuple(int(v) for v in pair) for pair in entry]
    if any(len(pair) != 2 for pair in sizes):
        raise ValueError(f"sample {sample}: image sizes must be (width, height) pairs, got {entry!r}")
    return sizes


def estimate_costs(
    image_sizes: Sequence[Any],
    text_tokens: int | Sequence[int],
    *,
    cost_model: CostModel | None = None,
    resize: ResizeRule | None = None,
) -> SampleCosts:
    """Per-sample costs from (width, height) image sizes and text lengths, no decoding.

    ``text_tokens`` counts the sample's text tokens (prompt and document text); the image
    markers and the P / merge_size**2 placeholder tokens per image are added here. Raises
    ``ValueError`` naming the sample for a malformed size or a length mismatch.
    """
    cost_model = cost_model or CostModel()
    resize = resize or ResizeRule()
    n = len(image_sizes)
    if isinstance(text_tokens, (int, np.integer)):
        text = [int(text_tokens)] * n
    else:
        text = [int(t) for t in text_tokens]
        if len(text) != n:
            raise ValueError(f"image_sizes has {n} samples but text_tokens has {len(text)}; give one per sample")
    grids, counts, seq_lens = [], [], []
    per_token_of_patch = resize.merge_size**2
    for i, entry in enumerate(image_sizes):
        sample_grids = []
        for width, height in _as_size_list(entry, i):
            try:
                sample_grids.append(resize.grid(width, height))
            except ValueError as err:
                raise ValueError(f"sample {i}: {err}") from err
        grids.extend(sample_grids)
        counts.append(len(sample_grids))
        visual = sum(t * h * w // per_token_of_patch + IMAGE_MARKER_TOKENS for t, h, w in sample_grids)
        seq_lens.append(text[i] + visual)
    grid_thw = torch.tensor(grids, dtype=torch.long).reshape(-1, 3)
    feats = cost_features(grid_thw, counts, torch.tensor(seq_lens, dtype=torch.long))
    return SampleCosts(
        costs=cost_model.costs_from_features(feats).numpy(),
        patches=feats[:, 1].numpy().astype(np.int64),
        seq_lens=np.asarray(seq_lens, dtype=np.int64),
        features=feats.numpy(),
    )

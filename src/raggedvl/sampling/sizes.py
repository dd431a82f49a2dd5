"""Per-sample costs from image headers or sizes, without decoding a pixel.

Each image goes through ``raggedvl.images.ImagePolicy`` (the same policy the collators apply:
EXIF orientation, white padding of extreme strips, scaling up of tiny images, transformers'
``smart_resize``), which gives its grid (t=1, h, w) in patches: P = h*w rows of
``pixel_values`` and P / merge_size**2 placeholder tokens in the text. ``estimate_costs`` turns
the grids and a text length into per-sample costs with ``raggedvl.batch.costs.CostModel``, plus
per-sample patch counts (the memory proxy that
``BalancedDistributedBatchSampler(max_patches_per_rank=...)`` caps). For every image the
collators accept, the estimate's patch count equals the collator's ``pixel_values`` rows.

Shapes: N samples; ``images`` N entries, each None (text only), one image or a list of them,
an image being a (width, height) pair of ints or any ``raggedvl.images.ImageSource`` (path,
bytes, ``{"bytes", "path"}`` dict, PIL image; only its header is read); ``text_tokens`` an int
or N ints; outputs [N] arrays.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from raggedvl.batch.costs import CostModel, cost_features
from raggedvl.images import BadImageError, BadImagePolicy, ImagePolicy, check_bad_image_policy

# <|vision_start|> and <|vision_end|> around every image's placeholder tokens.
IMAGE_MARKER_TOKENS = 2


@dataclass(frozen=True)
class SampleCosts:
    """``costs`` [N] float64 (cost-model units), ``patches`` [N] int64 (vision rows),
    ``seq_lens`` [N] int64 (text + markers + placeholder tokens), ``features`` [N, 4].
    ``skipped``: samples whose images were rejected under ``on_bad_image="skip"``, as
    ``{"sample", "name", "reason"}`` (``reason``: ``BadImageError.reason``, the short cause, without
    the fix the error suggests); they are costed as their text alone (0 patches), and a trainer
    leaves them out of its sampler's plan (:meth:`kept`)."""

    costs: np.ndarray
    patches: np.ndarray
    seq_lens: np.ndarray
    features: np.ndarray
    skipped: list[dict[str, Any]] = field(default_factory=list)

    def kept(self) -> np.ndarray:
        """[N - len(skipped)] int64, ascending: the samples not in ``skipped``."""
        keep = np.ones(len(self.costs), dtype=bool)
        keep[[bad["sample"] for bad in self.skipped]] = False
        return np.flatnonzero(keep)


def _images_of(entry: Any, sample: str) -> list[Any]:
    """One sample's images: [] for None, [entry] for one image, the list for several."""
    if entry is None:
        return []
    if isinstance(entry, (list, tuple)) and len(entry) == 2 and all(isinstance(v, (int, np.integer)) for v in entry):
        return [entry]  # one (width, height) pair
    if isinstance(entry, (list, tuple)):
        for item in entry:
            if isinstance(item, (list, tuple)) and (len(item) != 2 or not all(isinstance(v, (int, np.integer)) for v in item)):
                raise ValueError(f"{sample}: image sizes must be (width, height) pairs of ints, got {entry!r}")
        return list(entry)
    return [entry]


def estimate_costs(
    images: Sequence[Any],
    text_tokens: int | Sequence[int],
    *,
    cost_model: CostModel | None = None,
    policy: ImagePolicy | None = None,
    on_bad_image: BadImagePolicy = "error",
    names: Sequence[str] | None = None,
) -> SampleCosts:
    """Per-sample costs from images (sizes or headers) and text lengths, no decoding.

    ``text_tokens`` counts the sample's text tokens (prompt and document text); the image
    markers and the P / merge_size**2 placeholder tokens per image are added here. ``policy``
    is the processor's (``ImagePolicy.from_processor``; default: transformers' defaults).
    ``names`` (N strings) say how errors refer to each sample (default ``"sample i"``).

    Raises:
        BadImageError: under ``on_bad_image="error"``, an image the collators would reject
            (unreadable header, empty or above ``max_source_pixels``), naming the sample; under
            "skip" the sample is costed as text only and listed in ``SampleCosts.skipped``.
        ValueError: a malformed size entry or a length mismatch.
    """
    check_bad_image_policy(on_bad_image)
    cost_model = cost_model or CostModel()
    policy = policy or ImagePolicy()
    n = len(images)
    if names is not None and len(names) != n:
        raise ValueError(f"images has {n} samples but names has {len(names)}; give one per sample")
    if isinstance(text_tokens, (int, np.integer)):
        text = [int(text_tokens)] * n
    else:
        text = [int(t) for t in text_tokens]
        if len(text) != n:
            raise ValueError(f"images has {n} samples but text_tokens has {len(text)}; give one per sample")
    grids, counts, seq_lens, skipped = [], [], [], []
    per_token_of_patch = policy.merge_size**2
    for i, entry in enumerate(images):
        label = names[i] if names is not None else f"sample {i}"
        items = _images_of(entry, label)
        try:
            sample_grids = [
                policy.inspect(item, name=f"{label}: image {j}" if len(items) > 1 else f"{label}: image").grid
                for j, item in enumerate(items)
            ]
        except BadImageError as exc:
            if on_bad_image == "error":
                raise
            skipped.append({"sample": i, "name": label, "reason": exc.reason})  # the cause: the label names the row
            sample_grids = []
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
        skipped=skipped,
    )

"""Invariant checks of a ragged batch (DESIGN.md section 2, case C09).

Every check raises ``ValueError`` naming the sample (or item), the numbers involved and the
likely fix. Shape legend: B samples, L tokens, N items of one stream (images or videos),
P patch rows = sum over items of t*h*w, D_p patch_dim.
"""

from __future__ import annotations

from bisect import bisect_right
from itertools import accumulate
from typing import Mapping, Sequence

import torch

from raggedvl.families import BatchLayout, VisualStream


def owner_of(item: int, counts: Sequence[int]) -> int:
    """Index of the sample that owns item ``item`` given items per sample ``counts``."""
    return bisect_right(list(accumulate(counts)), item)


def check_sample_tensors(layout: BatchLayout, sample: Mapping[str, torch.Tensor]) -> int:
    """All per-sample tensors agree on B (at their sample dim) and L (their last dim), and every
    sample has at least one real token in ``attention_mask`` (when given).

    Returns B. Raises ``ValueError`` naming the disagreeing keys and shapes, or the empty samples.
    """
    if "input_ids" not in sample:
        raise ValueError(f"a {layout.name} batch needs input_ids [B, L]; got keys {sorted(sample)}")
    ids = sample["input_ids"]
    if ids.dim() != 2:
        raise ValueError(f"input_ids must be [B, L], got shape {list(ids.shape)}; batch 1-D inputs with [None]")
    batch, length = ids.shape
    for key, t in sample.items():
        dim = layout.sample_dims[key]
        if t.dim() <= dim or t.shape[dim] != batch or t.shape[-1] != length:
            raise ValueError(
                f"{key} has shape {list(t.shape)} but input_ids is [{batch}, {length}]: {key} must have "
                f"{batch} samples at dim {dim} and {length} tokens in its last dim"
            )
    mask = sample.get("attention_mask")
    if mask is not None and length and batch:
        empty = (mask == 0).all(dim=-1).nonzero().flatten().tolist()
        if empty:
            raise ValueError(
                f"samples {empty[:8]} have an all-zero attention_mask (no real token); every sample needs at "
                "least one (drop empty samples before batching)"
            )
    return batch


def check_counts(stream: VisualStream, counts: Sequence[int], num_samples: int, num_items: int) -> None:
    """``counts`` gives one non-negative count per sample and sums to the grid rows."""
    if len(counts) != num_samples:
        raise ValueError(
            f"{stream.name}_counts has {len(counts)} entries for {num_samples} samples; give one count per sample"
        )
    for b, c in enumerate(counts):
        if c < 0:
            raise ValueError(f"sample {b} has {stream.name} count {c}; counts must be >= 0")
    if sum(counts) != num_items:
        raise ValueError(
            f"{stream.name}_counts {list(counts)} sum to {sum(counts)} but {stream.grid_key} has {num_items} rows; "
            f"each {stream.name} needs exactly one grid row (was a grid row dropped, or an item's text removed?)"
        )


def check_grid(layout: BatchLayout, stream: VisualStream, grid: torch.Tensor, counts: Sequence[int]) -> None:
    """Grid rows are positive (t, h, w) with h and w multiples of merge_size; ``counts`` (items per
    sample, may be empty when not yet known) names the owning sample."""
    if grid.dim() != 2 or grid.shape[1] != 3:
        raise ValueError(f"{stream.grid_key} must be [N, 3] (t, h, w in patches), got shape {list(grid.shape)}")
    if grid.is_floating_point():
        raise ValueError(f"{stream.grid_key} must hold integers (patches), got dtype {grid.dtype}")
    m = layout.merge_size
    bad = (grid <= 0).any(dim=1) | (grid[:, 1] % m != 0) | (grid[:, 2] % m != 0)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        owner = f" (sample {owner_of(i, counts)})" if counts else ""
        raise ValueError(
            f"{stream.name} {i}{owner} has grid {grid[i].tolist()}: t, h, w must be "
            f"positive and h, w multiples of merge_size {m}; resize the {stream.name} with the processor's smart_resize"
        )


def check_patches(
    layout: BatchLayout, stream: VisualStream, patches: torch.Tensor | None, patch_counts: torch.Tensor
) -> None:
    """Patch rows equal the sum of the grid products; patch_dim matches the layout."""
    expected = int(patch_counts.sum())
    rows = 0 if patches is None else patches.shape[0]
    if patches is not None and (patches.dim() != 2 or patches.shape[1] != layout.patch_dim):
        raise ValueError(
            f"{stream.patches_key} must be [P, {layout.patch_dim}] for layout {layout.name}, got "
            f"{list(patches.shape)}; use the layout of your model family (or a BatchLayout with its patch_dim)"
        )
    if rows != expected:
        raise ValueError(
            f"{stream.patches_key} has {rows} patch rows but the {stream.grid_key} products sum to {expected} "
            f"({patch_counts.tolist()}); patches and grids were separated (split by position?)"
        )


def check_item_tensors(stream: VisualStream, extras: Mapping[str, torch.Tensor], num_items: int) -> None:
    """Per-item extras (e.g. second_per_grid_ts) have one row per item."""
    for key, t in extras.items():
        if t.dim() == 0 or t.shape[0] != num_items:
            raise ValueError(f"{key} has shape {list(t.shape)} but there are {num_items} {stream.name}s; give one row each")


def check_placeholders(
    layout: BatchLayout,
    stream: VisualStream,
    tokens_B: torch.Tensor,
    grid: torch.Tensor,
    counts: Sequence[int],
) -> None:
    """Each sample's placeholder tokens equal sum(t*h*w) / merge_size**2 over its items (C09)."""
    visual = grid.to(torch.int64).prod(dim=1) // (layout.merge_size**2) if grid.numel() else torch.zeros(0, dtype=torch.int64)
    owner = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(list(counts), dtype=torch.int64))
    per_sample = torch.zeros(len(counts), dtype=torch.int64).index_add_(0, owner, visual)
    mismatch = (per_sample != tokens_B.to(torch.int64)).nonzero()
    if mismatch.numel():
        b = int(mismatch[0, 0])
        start = sum(counts[:b])
        grids = ", ".join(str(g) for g in grid[start : start + counts[b]].tolist()) or "none"
        raise ValueError(
            f"sample {b} has {int(tokens_B[b])} {stream.name} placeholder tokens but its {counts[b]} "
            f"{stream.name}s give {int(per_sample[b])} visual tokens (grids {grids}); was the text truncated "
            f"(raise max_length) or a grid row dropped?"
        )


def check_token_types(stream: VisualStream, is_token_BL: torch.Tensor, mm_token_type_ids: torch.Tensor) -> None:
    """``mm_token_type_ids`` marks exactly the placeholder tokens of this stream with its type id."""
    marked = mm_token_type_ids == stream.type_id
    diff = (marked != is_token_BL).nonzero()
    if diff.numel():
        b, pos = (int(x) for x in diff[0])
        raise ValueError(
            f"sample {b}, token {pos}: mm_token_type_ids marks {int(marked[b].sum())} {stream.name} tokens but "
            f"input_ids has {int(is_token_BL[b].sum())}; rebuild mm_token_type_ids with the processor "
            f"(value {stream.type_id} exactly at {stream.name} placeholders)"
        )


def check_vision_starts(stream: VisualStream, bad: list[tuple[int, int]], vision_start_id: int) -> None:
    """Every placeholder run is opened by ``<|vision_start|>``."""
    if bad:
        b, pos = bad[0]
        raise ValueError(
            f"sample {b}: the {stream.name} placeholder run at token {pos} is not preceded by <|vision_start|> "
            f"(id {vision_start_id}); was the text truncated from the left, or are the token ids wrong "
            f"(pass token_ids=processor)?"
        )


def check_ownership(lay: BatchLayout, s: VisualStream, tokens_B: torch.Tensor, grid: torch.Tensor,
                    counts: Sequence[int]) -> None:
    """When ``counts`` and the grid rows disagree in total, name the first sample whose placeholder
    tokens have no matching grid rows (a grid row was dropped or added), walking the grids in order."""
    visual = (grid.to(torch.int64).prod(dim=1) // lay.merge_size**2).tolist()
    start = 0
    for b, c in enumerate(counts):
        mine = visual[start : start + c]
        if len(mine) < c or sum(mine) != int(tokens_B[b]):
            raise ValueError(
                f"sample {b} has {int(tokens_B[b])} {s.name} placeholder tokens for {c} {s.name}s but the "
                f"{s.grid_key} rows left for it give {len(mine)} {s.name}s with {sum(mine)} visual tokens "
                f"(the batch has {grid.shape[0]} grid rows for {sum(counts)} {s.name}s); a grid row was dropped "
                f"or added: rebuild the batch with the processor"
            )
        start += c
    hint = (
        "; no placeholder run was found at all: if the tokenizer's placeholder ids differ from Qwen's "
        "(e.g. the tiny preset), pass token_ids=processor to RaggedBatch.from_features"
        if sum(counts) == 0 else ""
    )
    raise ValueError(f"{s.grid_key} has {grid.shape[0]} rows for {sum(counts)} {s.name} placeholder runs; "
                     f"extra grid rows belong to no sample{hint}")

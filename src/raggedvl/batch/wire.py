"""A ragged batch as a flat dict of tensors that accelerate can concatenate, broadcast and slice.

Shape legend: B samples, L padded tokens per sample, T = sum of valid tokens over the batch,
N items (images or videos) of a stream, P patch rows, D_p patch_dim.

Why: accelerate's ``dispatch_batches`` path (the default for an ``IterableDataset``) fetches W
batches on process 0, ``concatenate`` s them tensor by tensor along dim 0, broadcasts the result
by shape and slices it with a ``slice_fn``. A :class:`~raggedvl.batch.RaggedBatch` is not a
tensor tree, and its ``[B, L]`` tensors cannot be concatenated when the batches were padded to
different L. The *wire form* keeps every tensor flat along its own rows, so row-wise
concatenation of two wire batches is the wire form of the concatenated batch:

=========================  ========  =========================================================
key                        shape     meaning
=========================  ========  =========================================================
``ragged_num_tokens``      [B]       valid tokens per sample (first key: accelerate's batch size)
``ragged_left_padded``     [B]       1 when the sample was padded on the left
each per-sample key        [T]       ``input_ids``, ``attention_mask``, ``labels``, ... valid tokens only
``ragged_<stream>_counts`` [B]       items per sample (``image``, ``video``)
grid key                   [N, 3]    ``image_grid_thw`` / ``video_grid_thw`` (zero rows when none)
patches key                [P, D_p]  ``pixel_values`` / ``pixel_values_videos`` (zero rows when none)
per-item extras            [N, ...]  e.g. ``second_per_grid_ts``
=========================  ========  =========================================================

:func:`unpack` rebuilds the batch, padding each sample on its own side to the longest sample,
and validates it (placeholders vs grids per sample). :func:`slice_samples` cuts whole samples
out of a wire batch by position. Nothing here communicates.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from raggedvl.families import BatchLayout, get_layout
from .offsets import boundaries
from .ragged import RaggedBatch

NUM_TOKENS = "ragged_num_tokens"
LEFT_PADDED = "ragged_left_padded"


def counts_key(stream: str) -> str:
    """Wire key of the items-per-sample counts of ``stream``."""
    return f"ragged_{stream}_counts"


def is_wire(obj: Any) -> bool:
    """True for a dict in wire form."""
    return isinstance(obj, Mapping) and NUM_TOKENS in obj


def _row_mask(n_B: torch.Tensor, left_B: torch.Tensor, length: int) -> torch.Tensor:
    """[B, L] bool: where each sample's valid tokens sit when padded to ``length``."""
    col_L = torch.arange(length, device=n_B.device)
    right = col_L[None, :] < n_B[:, None]
    left = col_L[None, :] >= (length - n_B)[:, None]
    return torch.where(left_B.bool()[:, None], left, right)


def pack(batch: RaggedBatch) -> dict[str, torch.Tensor]:
    """The wire form of ``batch`` (see module docstring); tensors stay on their device.

    Raises ``ValueError`` when a per-sample tensor is not [B, L] with the sample on dim 0
    (mRoPE ``position_ids``: drop it, the model recomputes it) or when a sample's
    ``attention_mask`` is not one contiguous run of ones at the start or end of its row.
    """
    lay = batch.layout
    sample_keys = [k for k in batch.keys() if k in lay.sample_dims]
    ids_BL = batch["input_ids"]
    for k in sample_keys:
        if lay.sample_dims[k] != 0 or batch[k].dim() != 2 or tuple(batch[k].shape) != tuple(ids_BL.shape):
            raise ValueError(
                f"{k!r} has shape {tuple(batch[k].shape)} (sample dim {lay.sample_dims[k]}); the wire form "
                f"takes per-sample tensors shaped like input_ids {tuple(ids_BL.shape)}: drop {k!r} from the "
                "collator output (the model computes position_ids itself)"
            )
    mask_BL = batch["attention_mask"].bool() if "attention_mask" in sample_keys else torch.ones_like(ids_BL, dtype=torch.bool)
    n_B = mask_BL.sum(dim=1)
    left_B = (~mask_BL[:, 0]) & (n_B > 0) if mask_BL.shape[1] else torch.zeros_like(n_B, dtype=torch.bool)
    expected = _row_mask(n_B, left_B, mask_BL.shape[1])
    bad = (expected != mask_BL).any(dim=1).nonzero().flatten().tolist()
    if bad:
        b = bad[0]
        raise ValueError(
            f"sample {b}'s attention_mask {mask_BL[b].int().tolist()} is not one run of ones padded on one side; "
            "the wire form keeps only valid tokens: pad each row on the left or the right only"
        )
    wire: dict[str, torch.Tensor] = {NUM_TOKENS: n_B.to(torch.int64), LEFT_PADDED: left_B.to(torch.int64)}
    for k in sample_keys:
        wire[k] = batch[k][mask_BL]
    for s in lay.streams:
        wire[counts_key(s.name)] = torch.tensor(batch.counts(s.name), dtype=torch.int64, device=ids_BL.device)
        if s.grid_key in batch:
            wire[s.grid_key] = batch[s.grid_key]
            wire[s.patches_key] = batch[s.patches_key]
            for k in s.item_keys:
                if k in batch:
                    wire[k] = batch[k]
        else:
            wire[s.grid_key] = torch.zeros(0, 3, dtype=torch.int64, device=ids_BL.device)
            wire[s.patches_key] = torch.zeros(0, lay.patch_dim, device=ids_BL.device)
    return wire


def unpack(wire: Mapping[str, torch.Tensor], layout: str | BatchLayout = "qwen2_vl", *, token_ids: Any = None,
           pad_token_id: int = 0, validate: bool = True) -> RaggedBatch:
    """Rebuild the :class:`RaggedBatch` of a wire dict (inverse of :func:`pack`).

    Each sample is padded to the longest sample of the wire batch on the side it was padded on
    (``input_ids`` with ``pad_token_id``, other keys with ``layout.pad_values``). ``token_ids``:
    anything ``RaggedBatch.from_features`` accepts. Raises ``ValueError`` when the token rows do
    not add up to ``ragged_num_tokens`` or (from ``RaggedBatch.from_features``) when the rows do
    not form a valid batch, e.g. a slice by position that cut patches away from their grids.
    """
    lay = get_layout(layout)
    n_B = wire[NUM_TOKENS]
    length = int(n_B.max()) if n_B.numel() else 0
    mask_BL = _row_mask(n_B, wire[LEFT_PADDED], length)
    stream_keys = {NUM_TOKENS, LEFT_PADDED}
    for s in lay.streams:
        stream_keys.update((counts_key(s.name), s.grid_key, s.patches_key, *s.item_keys))
    feats: dict[str, torch.Tensor] = {}
    total = int(n_B.sum())
    for k, flat in wire.items():
        if k in stream_keys:
            continue
        if flat.shape[:1] != (total,):
            raise ValueError(
                f"wire batch: {k!r} has {flat.shape[0] if flat.dim() else 0} token rows but ragged_num_tokens "
                f"{n_B.tolist()} sum to {total}; the batch was cut by position (slice it with "
                "raggedvl.parallel.RaggedDispatchSlicer, not accelerate's slice_tensors)"
            )
        pad = pad_token_id if k == "input_ids" else lay.pad_values.get(k, 0)
        full = torch.full(tuple(mask_BL.shape), pad, dtype=flat.dtype, device=flat.device)
        full[mask_BL] = flat
        feats[k] = full
    counts: dict[str, list[int]] = {}
    for s in lay.streams:
        counts[s.name] = wire[counts_key(s.name)].tolist() if counts_key(s.name) in wire else [0] * n_B.numel()
        if s.grid_key in wire and wire[s.grid_key].shape[0]:
            for k in (s.grid_key, s.patches_key, *s.item_keys):
                if k in wire:
                    feats[k] = wire[k]
    return RaggedBatch.from_features(
        feats, lay, image_counts=counts.get("image"), video_counts=counts.get("video"),
        token_ids=token_ids, validate=validate,
    )


def slice_samples(wire: Mapping[str, torch.Tensor], start: int, stop: int | None,
                  layout: str | BatchLayout = "qwen2_vl") -> dict[str, torch.Tensor]:
    """Samples ``start:stop`` (clipped to the batch; ``stop=None``: to the end) of a wire batch,
    with exactly their tokens, grids and patch rows (views, no copy). Raises ``ValueError`` when
    the item counts do not add up to the grid rows."""
    lay = get_layout(layout)
    n_B = wire[NUM_TOKENS]
    start, stop = max(0, start), n_B.numel() if stop is None else min(stop, n_B.numel())
    stop = max(start, stop)
    tok = boundaries(n_B)
    out: dict[str, torch.Tensor] = {NUM_TOKENS: n_B[start:stop], LEFT_PADDED: wire[LEFT_PADDED][start:stop]}
    claimed = {NUM_TOKENS, LEFT_PADDED}
    for s in lay.streams:
        ck = counts_key(s.name)
        if ck not in wire:
            continue
        counts = wire[ck]
        grid = wire[s.grid_key]
        if int(counts.sum()) != grid.shape[0]:
            raise ValueError(
                f"wire batch: {s.name} counts {counts.tolist()} sum to {int(counts.sum())} but {s.grid_key} has "
                f"{grid.shape[0]} rows; the batch was not built by raggedvl.batch.wire.pack"
            )
        items = boundaries(counts)
        patches = boundaries(grid.prod(dim=1))
        i0, i1 = items[start], items[stop]
        out[ck] = counts[start:stop]
        out[s.grid_key] = grid[i0:i1]
        out[s.patches_key] = wire[s.patches_key][patches[i0]:patches[i1]]
        for k in s.item_keys:
            if k in wire:
                out[k] = wire[k][i0:i1]
        claimed.update((ck, s.grid_key, s.patches_key, *s.item_keys))
    for k, flat in wire.items():
        if k not in claimed:
            out[k] = flat[tok[start]:tok[stop]]
    return {k: out[k] for k in wire if k in out}

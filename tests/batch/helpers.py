"""Comparison helpers for ragged batch tests."""

from __future__ import annotations

import torch

from raggedvl.batch import RaggedBatch


def assert_same_batch(a: RaggedBatch, b: RaggedBatch) -> None:
    """Same keys, same tensors (exact), same ownership."""
    assert a.keys() == b.keys(), (a.keys(), b.keys())
    for k in a.keys():
        assert a[k].dtype == b[k].dtype, k
        assert torch.equal(a[k], b[k]), k
    assert a.image_counts == b.image_counts
    assert a.video_counts == b.video_counts


def per_sample_parts(batch: RaggedBatch, b: int) -> dict:
    """Sample b's rows, reconstructed with a plain Python walk (the naive reference)."""
    lay = batch.layout
    out = {k: batch[k].select(lay.sample_dims[k], b) for k in batch.keys() if k in lay.sample_dims}
    for s in lay.streams:
        counts = batch.counts(s.name)
        if s.grid_key not in batch.keys() or counts[b] == 0:
            out[s.grid_key] = torch.zeros(0, 3, dtype=torch.int64)
            out[s.patches_key] = torch.zeros(0, lay.patch_dim)
            continue
        grid = batch[s.grid_key]
        first = sum(counts[:b])
        patch_first = int(sum(int(torch.prod(g)) for g in grid[:first]))
        mine = grid[first : first + counts[b]]
        n = int(sum(int(torch.prod(g)) for g in mine))
        out[s.grid_key] = mine
        out[s.patches_key] = batch[s.patches_key][patch_first : patch_first + n]
        for k in s.item_keys:
            if k in batch.keys():
                out[k] = batch[k][first : first + counts[b]]
    return out

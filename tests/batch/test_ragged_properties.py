"""Property tests (hypothesis) of RaggedBatch: split/concat, select, padded round trip, costs.

Random batches mix multi-image, zero-image and video samples over all three layouts.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from raggedvl.batch import CostModel, RaggedBatch

from .helpers import assert_same_batch, per_sample_parts
from .synth import SMALL_IDS, make_features

grid_st = st.tuples(st.integers(1, 2), st.integers(1, 4).map(lambda x: 2 * x), st.integers(1, 4).map(lambda x: 2 * x))
sample_st = st.fixed_dictionaries(
    {
        "images": st.lists(grid_st.map(lambda g: (1, g[1], g[2])), max_size=3),
        "videos": st.lists(grid_st, max_size=1),
        "text": st.integers(1, 5),
    }
)
batch_st = st.tuples(
    st.lists(sample_st, min_size=1, max_size=6),
    st.sampled_from(["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]),
    st.integers(0, 2**16),
)


def build(samples, layout, seed) -> RaggedBatch:
    feats = make_features(samples, layout, seed=seed, mrope=seed % 2 == 0, labels=True)
    return RaggedBatch.from_features(feats, layout, token_ids=SMALL_IDS)


@settings(max_examples=50, deadline=None)
@given(batch_st, st.data())
def test_concat_of_split_is_identity(spec, data):
    batch = build(*spec)
    B = batch.num_samples
    cuts = sorted(data.draw(st.lists(st.integers(0, B), max_size=3)))
    sizes = [b - a for a, b in zip([0, *cuts], [*cuts, B])]
    parts = batch.split(sizes)
    assert [p.num_samples for p in parts] == sizes
    for p in parts:
        p.validate()  # each part is self-consistent (patch rows, grids, placeholders)
        if sum(p.image_counts) == 0:
            assert "pixel_values" not in p.keys() and "image_grid_thw" not in p.keys()
    assert_same_batch(RaggedBatch.concat([p for p in parts if p.num_samples] or parts[:1]), batch)


@settings(max_examples=50, deadline=None)
@given(batch_st, st.data())
def test_select_equals_per_sample_reconstruction(spec, data):
    batch = build(*spec)
    idx = data.draw(st.lists(st.integers(0, batch.num_samples - 1), min_size=1, max_size=8))
    sel = batch.select(idx)
    sel.validate()
    for j, b in enumerate(idx):
        got, want = per_sample_parts(sel, j), per_sample_parts(batch, b)
        assert got.keys() == want.keys()
        for k in want:
            assert torch.equal(got[k], want[k]), (k, j, b)
    # selecting every sample in order reproduces the batch; selecting one at a time then concat too
    assert_same_batch(batch.select(range(batch.num_samples)), batch)
    assert_same_batch(RaggedBatch.concat([batch.select([b]) for b in range(batch.num_samples)]), batch)


@settings(max_examples=50, deadline=None)
@given(batch_st)
def test_padded_round_trip_is_identity(spec):
    batch = build(*spec)
    padded = batch.to_padded()
    if batch.num_images:
        pv = padded["pixel_values"]
        counts = batch.patch_counts("image")
        assert pv.shape == (batch.num_images, int(counts.max()), batch.layout.patch_dim)
        valid = torch.arange(pv.shape[1])[None, :] < counts[:, None]
        assert torch.count_nonzero(pv[~valid]) == 0  # padding is zeros
    back = RaggedBatch.from_padded(padded, batch.layout, token_ids=SMALL_IDS)
    assert_same_batch(back, batch)


@settings(max_examples=50, deadline=None)
@given(batch_st, st.data())
def test_costs_add_up(spec, data):
    batch = build(*spec)
    cm = CostModel(per_sample=1.5, per_patch=2.0, per_patch_pair=0.25, per_token=0.5)
    costs = batch.sample_costs(cm)
    assert costs.dtype == torch.float64 and costs.shape == (batch.num_samples,)
    # independent reference: sum the formula over each sample's own grids
    for b in range(batch.num_samples):
        parts = per_sample_parts(batch, b)
        p = torch.cat([parts["image_grid_thw"], parts["video_grid_thw"]]).prod(dim=1).double()
        ref = 1.5 + float((2.0 * p + 0.25 * p * p).sum()) + 0.5 * float(parts["attention_mask"].sum())
        assert abs(float(costs[b]) - ref) < 1e-9 * max(1.0, ref)
    idx = data.draw(st.permutations(range(batch.num_samples)))
    assert torch.equal(batch.select(idx).sample_costs(cm), costs[list(idx)])
    halves = batch.split([batch.num_samples // 2, batch.num_samples - batch.num_samples // 2])
    assert torch.allclose(sum(float(h.sample_costs(cm).sum()) for h in halves) * torch.ones(1, dtype=torch.float64),
                          costs.sum().reshape(1))


@settings(max_examples=50, deadline=None)
@given(batch_st, st.data())
def test_ownership_accessors_match_a_naive_walk(spec, data):
    batch = build(*spec)
    idx = data.draw(st.lists(st.integers(0, batch.num_samples - 1), min_size=1, max_size=6))
    for b_ in (batch, batch.select(idx)):
        sizes = b_.sample_sizes()
        assert sizes.dtype == torch.int64
        for stream, (grid_key, patches_key) in {"image": ("image_grid_thw", "pixel_values"),
                                                "video": ("video_grid_thw", "pixel_values_videos")}.items():
            parts = [per_sample_parts(b_, b) for b in range(b_.num_samples)]
            counts = [p[grid_key].shape[0] for p in parts]
            assert b_.counts(stream) == counts
            assert b_.item_offsets(stream).tolist() == [sum(counts[:b]) for b in range(len(counts))]
            grids = torch.cat([p[grid_key] for p in parts])
            rows = [int(g.prod()) for g in grids]
            assert b_.patch_counts(stream).tolist() == rows
            assert b_.patch_offsets(stream).tolist() == [sum(rows[:i]) for i in range(len(rows))]
            for i, start in enumerate(b_.patch_offsets(stream).tolist()):  # offsets address the item's rows
                owner = next(b for b in range(b_.num_samples) if b_.item_offsets(stream)[b] <= i < b_.item_offsets(stream)[b] + counts[b])
                mine = i - int(b_.item_offsets(stream)[owner])
                first = sum(int(g.prod()) for g in parts[owner][grid_key][:mine])
                assert torch.equal(b_[patches_key][start:start + rows[i]], parts[owner][patches_key][first:first + rows[i]])
        for b in range(b_.num_samples):
            p = per_sample_parts(b_, b)
            patches = p["pixel_values"].shape[0] + p["pixel_values_videos"].shape[0]
            assert int(sizes[b]) == patches + int(p["attention_mask"].sum())


def test_to_casts_floating_tensors_and_moves_the_rest_like_batch_feature():
    from transformers import BatchFeature

    feats = make_features([{"images": [(1, 2, 4)], "videos": [(2, 2, 2)], "text": 3}, {"images": [], "videos": [], "text": 2}],
                          "qwen2_vl", labels=True)
    batch = RaggedBatch.from_features(feats, "qwen2_vl", token_ids=SMALL_IDS)
    for args, kwargs in (((torch.float64,), {}), (("cpu",), {"dtype": torch.bfloat16}), ((), {"device": "cpu"}),
                         (("cpu", torch.float16), {"non_blocking": True})):
        moved = batch.to(*args, **kwargs)
        reference = BatchFeature(dict(feats)).to(*args, **kwargs)
        assert moved.keys() == batch.keys()
        for k in batch.keys():
            assert moved[k].dtype == reference[k].dtype, (k, args, kwargs)
            assert torch.equal(moved[k].to(batch[k].dtype), batch[k].to(reference[k].dtype).to(batch[k].dtype)), k
        assert (moved.image_counts, moved.video_counts) == (batch.image_counts, batch.video_counts)
    assert batch.to(torch.float64)["pixel_values"].dtype == torch.float64
    assert batch.to(torch.float64)["input_ids"].dtype == torch.int64  # ids are never cast
    with pytest.raises(ValueError, match="expected a device or a dtype"):
        batch.to([1, 2])

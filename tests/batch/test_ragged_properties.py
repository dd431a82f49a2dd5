"""Property tests (hypothesis) of RaggedBatch: split/concat, select, padded round trip, costs.

Random batches mix multi-image, zero-image and video samples over all three layouts.
"""

from __future__ import annotations

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

"""Property tests of the DataParallel scatter/gather logic (no model): for random ragged batches,
costs and replica counts, shards hold whole samples and the gather restores the original order
of per-sample, per-image and per-patch outputs exactly."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from raggedvl.batch import RaggedBatch
from raggedvl.parallel import gather_outputs, scatter_batch
from raggedvl.sampling.partition import partition_costs
from tests.batch.synth import SMALL_IDS, make_features

grid_st = st.tuples(st.just(1), st.integers(1, 3).map(lambda x: 2 * x), st.integers(1, 3).map(lambda x: 2 * x))
sample_st = st.fixed_dictionaries({"images": st.lists(grid_st, max_size=3), "text": st.integers(1, 4)})


@settings(max_examples=50, deadline=None)
@given(st.lists(sample_st, min_size=1, max_size=7), st.integers(1, 4), st.data())
def test_scatter_then_gather_is_identity(samples, replicas, data):
    batch = RaggedBatch.from_features(make_features(samples, labels=True, mrope=True), token_ids=SMALL_IDS)
    costs = data.draw(st.lists(st.floats(0, 100), min_size=len(samples), max_size=len(samples)))
    sc = scatter_batch(batch, replicas, costs, devices=["cpu"] * replicas)
    assert sc.indices == [p for p in partition_costs(costs, replicas) if p]
    assert len(sc.shards) == min(replicas, len(samples))
    for shard, idx in zip(sc.shards, sc.indices):
        shard.validate()
        assert shard.image_counts == [batch.image_counts[i] for i in idx]
        assert ("pixel_values" in shard) == (shard.num_images > 0)
    # a fake model output per shard: per-sample tensors, a per-image tuple, per-patch rows, a scalar
    outputs = [{"ids": s["input_ids"], "pos": s["position_ids"][0],
                "per_image": tuple(s["pixel_values"][int(a):int(a) + int(n)] for a, n in
                                   zip(torch.cumsum(s.patch_counts(), 0) - s.patch_counts(), s.patch_counts())),
                "patches": s["pixel_values"] if s.num_images else torch.zeros(0, 1176),
                "loss": s["input_ids"].sum().float()} for s in sc.shards]
    # samples and patch rows can coincide in number (a [1,2,2] image has 4 rows): names decide
    got = gather_outputs(outputs, sc, "cpu")
    assert torch.equal(got["ids"], batch["input_ids"])
    assert torch.equal(got["pos"], batch["position_ids"][0])
    if batch.num_images:
        flat = batch["pixel_values"]
        starts = torch.cumsum(batch.patch_counts(), 0) - batch.patch_counts()
        assert len(got["per_image"]) == batch.num_images
        for img, a, n in zip(got["per_image"], starts.tolist(), batch.patch_counts().tolist()):
            assert torch.equal(img, flat[a : a + n])
        assert torch.equal(got["patches"], flat)
    assert got["loss"].shape == (len(sc.shards),)

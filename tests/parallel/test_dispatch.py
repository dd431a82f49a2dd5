"""RaggedDispatchSlicer in one process: the slice accelerate computes, applied to whole samples of
feature dicts and wire-form batches, through nested collator outputs (the multi-process case C03
is tests/dist/test_accelerate_dispatch.py)."""

from __future__ import annotations

import pytest
import torch
from accelerate.utils import slice_tensors
from transformers import BatchFeature

from raggedvl.batch import RaggedBatch
from raggedvl.batch.wire import pack, unpack
from raggedvl.parallel import RaggedDispatchSlicer
from tests.batch.helpers import assert_same_batch
from tests.batch.synth import SMALL_IDS, make_features
from tests.batch.test_wire import MIXED, TEXT_ONLY, batch_of

SPECS = [{"images": [(1, 4, 4)]}, {"text": 2}, {"images": [(1, 2, 2), (1, 8, 6)]}, {"images": [(1, 6, 6)]}]


def test_slices_whole_samples_of_nested_collator_output():
    docs = make_features(SPECS, labels=True, mrope=True)
    queries = make_features([{"text": 2 + i} for i in range(4)])
    full = {"queries": queries, "docs": BatchFeature(docs), "ids": ["a", "b", "c", "d"], "w": torch.arange(4.0)}
    slicer = RaggedDispatchSlicer("qwen2_vl", SMALL_IDS)
    ref = RaggedBatch.from_features(docs, token_ids=SMALL_IDS)
    for rank in range(2):
        part = slicer(full, slice(2 * rank, 2 * rank + 2), process_index=rank, num_processes=2)
        assert part["ids"] == ["a", "b", "c", "d"][2 * rank : 2 * rank + 2]
        assert torch.equal(part["w"], torch.arange(4.0)[2 * rank : 2 * rank + 2])
        assert isinstance(part["docs"], BatchFeature) and isinstance(part["queries"], dict)
        got = RaggedBatch.from_features(part["docs"], token_ids=SMALL_IDS)
        want = ref.select([2 * rank, 2 * rank + 1])
        assert got.keys() == want.keys()
        for k in want.keys():
            assert torch.equal(got[k], want[k]), k
        assert torch.equal(part["queries"]["input_ids"], queries["input_ids"][2 * rank : 2 * rank + 2])
    # a RaggedBatch leaf is selected, not sliced by position
    assert slicer(ref, slice(1, 3)).image_counts == [0, 2]


def test_rejects_slices_measured_on_patch_rows_and_broken_full_batches():
    slicer = RaggedDispatchSlicer("qwen2_vl", SMALL_IDS)
    docs = make_features(SPECS)
    pixel_first = {"pixel_values": docs["pixel_values"], **docs}
    with pytest.raises(ValueError, match="samples 0:43 of a batch of 4 samples"):
        slicer(pixel_first, slice(0, 43 * 1))
    # per-sample mRoPE positions concatenated along dim 0 (accelerate's concatenate) are caught
    a = make_features(SPECS[:2], mrope=True, pad_to=30)
    b = make_features(SPECS[2:], mrope=True, pad_to=30)
    glued = {k: torch.cat([a[k], b[k]]) for k in a if k in b}
    glued.update(pixel_values=b["pixel_values"], image_grid_thw=b["image_grid_thw"])
    glued["pixel_values"] = torch.cat([a["pixel_values"], b["pixel_values"]])
    glued["image_grid_thw"] = torch.cat([a["image_grid_thw"], b["image_grid_thw"]])
    with pytest.raises(ValueError, match=r"position_ids has shape \[6, 2, 30\] but input_ids is \[4, 30\]"):
        slicer(glued, slice(0, 2))


def test_wire_batches_keep_whole_samples_where_position_slicing_breaks():
    queries, docs = batch_of(TEXT_ONLY * 2, seed=3), batch_of(MIXED, seed=4)
    tree = {"queries": pack(queries), "docs": pack(docs)}
    broken = slice_tensors(tree, slice(0, 2))  # accelerate's default
    with pytest.raises(ValueError):
        unpack(broken["docs"], token_ids=SMALL_IDS)
    slice_fn = RaggedDispatchSlicer(token_ids=SMALL_IDS)
    for p in range(2):
        part = slice_fn(tree, slice(2 * p, 2 * p + 2), process_index=p, num_processes=2)
        got_docs = unpack(part["docs"], token_ids=SMALL_IDS)
        want = docs.select([2 * p, 2 * p + 1])
        assert got_docs.image_counts == want.image_counts
        assert torch.equal(got_docs["image_grid_thw"], want["image_grid_thw"])
        assert torch.equal(got_docs["pixel_values"], want["pixel_values"])
        assert unpack(part["queries"], token_ids=SMALL_IDS).num_samples == 2


def test_plain_feature_dicts_padded_to_one_length_are_cut_by_samples():
    feats = make_features(MIXED, pad_to=80)
    part = RaggedDispatchSlicer(token_ids=SMALL_IDS)(feats, slice(2, 4))
    got = RaggedBatch.from_features(part, token_ids=SMALL_IDS)
    want = RaggedBatch.from_features(feats, token_ids=SMALL_IDS).select([2, 3])
    assert_same_batch(got, want)

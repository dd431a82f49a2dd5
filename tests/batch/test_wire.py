"""Wire form (raggedvl.batch.wire): pack / unpack round trips, concatenation, slicing by samples
(accelerate's dispatch of wire batches is tested in tests/parallel/test_dispatch.py)."""

from __future__ import annotations

import pytest
import torch
from accelerate.utils import concatenate

from raggedvl.batch import RaggedBatch
from raggedvl.batch.wire import is_wire, pack, slice_samples, unpack
from tests.batch.helpers import assert_same_batch
from tests.batch.synth import SMALL_IDS, make_features

MIXED = [
    {"images": [(1, 4, 4), (1, 8, 6)], "text": 3},
    {"text": 5},
    {"images": [(1, 2, 2)], "videos": [(2, 4, 4)], "text": 2},
    {"images": [(1, 6, 6)], "text": 1},
]
TEXT_ONLY = [{"text": 9}, {"text": 2}]


def batch_of(samples, seed=0, labels=True):
    return RaggedBatch.from_features(make_features(samples, seed=seed, labels=labels), token_ids=SMALL_IDS)


def left_padded(batch: RaggedBatch) -> RaggedBatch:
    """The same samples padded on the left."""
    feats = dict(batch.items())
    mask = feats["attention_mask"]
    n = mask.sum(1)
    L = mask.shape[1]
    for k in ("input_ids", "attention_mask", "mm_token_type_ids", "labels"):
        rows = [torch.roll(feats[k][b], int(L - n[b])) for b in range(batch.num_samples)]
        feats[k] = torch.stack(rows)
    return RaggedBatch.from_features(feats, image_counts=batch.image_counts, video_counts=batch.video_counts, token_ids=SMALL_IDS)


@pytest.mark.parametrize("samples", [MIXED, TEXT_ONLY])
@pytest.mark.parametrize("side", ["right", "left"])
def test_pack_unpack_round_trip(samples, side):
    batch = batch_of(samples)
    if side == "left":
        batch = left_padded(batch)
    wire = pack(batch)
    assert is_wire(wire) and next(iter(wire)) == "ragged_num_tokens"
    assert all(isinstance(v, torch.Tensor) for v in wire.values())
    assert_same_batch(unpack(wire, token_ids=SMALL_IDS), batch)


def test_concatenated_wire_batches_are_the_concatenated_batch():
    """accelerate's concatenate works on wire form even for different L and a batch without images."""
    a, b = batch_of(MIXED, seed=1), batch_of(TEXT_ONLY, seed=2)
    assert a["input_ids"].shape[1] != b["input_ids"].shape[1]
    joined = unpack(concatenate([pack(a), pack(b)]), token_ids=SMALL_IDS)
    assert_same_batch(joined, RaggedBatch.concat([a, b]))


def test_slice_samples_equals_select_for_every_range():
    batch = batch_of(MIXED)
    wire = pack(batch)
    for start in range(batch.num_samples + 1):
        for stop in range(start, batch.num_samples + 1):
            got = unpack(slice_samples(wire, start, stop), token_ids=SMALL_IDS)
            want = batch.select(list(range(start, stop)))
            assert got.image_counts == want.image_counts and got.video_counts == want.video_counts
            for k in want.keys():
                w = want[k]
                if k in ("input_ids", "attention_mask", "mm_token_type_ids", "labels"):
                    w = w[:, : got[k].shape[1]]  # unpack pads to the longest selected sample only
                    assert not want["attention_mask"][:, got[k].shape[1]:].any()
                assert torch.equal(got[k], w), (start, stop, k)


def test_pack_rejects_interior_padding_and_mrope_positions():
    feats = make_features(MIXED)
    feats["attention_mask"][1, 1] = 0
    with pytest.raises(ValueError, match="sample 1's attention_mask"):
        pack(RaggedBatch.from_features(feats, token_ids=SMALL_IDS, validate=False))
    with pytest.raises(ValueError, match="position_ids"):
        pack(RaggedBatch.from_features(make_features(MIXED, mrope=True), token_ids=SMALL_IDS))

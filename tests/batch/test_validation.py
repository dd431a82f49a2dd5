"""Validation and ownership: cases C02 and C09, and every invariant of DESIGN.md section 2."""

from __future__ import annotations

import re

import pytest
import torch

from raggedvl.batch import RaggedBatch, TokenIds

from .helpers import per_sample_parts
from .synth import SMALL_IDS, make_features

# CASES.md shapes: 448x448 -> [1,32,32] (256 tokens), 224x224 -> [1,16,16] (64), 28x28 -> [1,2,2] (1)
G448, G224, G28 = (1, 32, 32), (1, 16, 16), (1, 2, 2)


def three_samples() -> dict:
    return make_features([{"images": [G224, G28]}, {"text": 4}, {"images": [(1, 8, 12)]}], labels=True)


def test_c02_select_multi_and_zero_image_samples():
    batch = RaggedBatch.from_features(three_samples(), token_ids=SMALL_IDS)
    assert batch.image_counts == [2, 0, 1]
    sel = batch.select([2, 0])
    assert sel.image_counts == [1, 2]
    assert sel["image_grid_thw"].tolist() == [[1, 8, 12], [1, 16, 16], [1, 2, 2]]
    pv = batch["pixel_values"]  # rows: sample 0 (256 + 4), sample 2 (96)
    assert torch.equal(sel["pixel_values"], torch.cat([pv[260:356], pv[0:260]]))
    assert torch.equal(sel["input_ids"], batch["input_ids"][[2, 0]])
    assert torch.equal(sel["labels"], batch["labels"][[2, 0]])
    text_only = batch.select([1])
    assert "pixel_values" not in text_only and "image_grid_thw" not in text_only.keys()
    assert text_only.image_counts == [0] and text_only.num_images == 0
    kwargs = dict(**text_only)  # model(**batch) sees no pixel_values at all
    assert set(kwargs) == {"input_ids", "attention_mask", "mm_token_type_ids", "labels"}


def test_a_sample_without_a_real_token_is_rejected_when_the_batch_is_built():
    """On the host, once per batch: the loss and the pooling skip their own check of an empty
    mask on an accelerator (it would be a device sync per step)."""
    features = three_samples()
    features["attention_mask"][1] = 0
    with pytest.raises(ValueError, match=r"samples \[1\] have an all-zero attention_mask"):
        RaggedBatch.from_features(features, token_ids=SMALL_IDS)


def test_c09_truncation_through_placeholders_raises_naming_the_sample():
    feats = make_features([{"text": 3}, {"images": [G448], "text": 100}])
    assert feats["input_ids"].shape[1] > 200
    cut = {k: v[..., :200] for k, v in feats.items() if k in ("input_ids", "attention_mask", "mm_token_type_ids")}
    cut.update(pixel_values=feats["pixel_values"], image_grid_thw=feats["image_grid_thw"])
    with pytest.raises(ValueError, match=r"sample 1 has 198 image placeholder tokens but its 1 images give 256 visual tokens \(grids \[1, 32, 32\]\); was the text truncated"):
        RaggedBatch.from_features(cut, token_ids=SMALL_IDS)


def test_one_placeholder_token_removed_raises_naming_the_sample():
    feats = make_features([{"images": [G224]}, {"images": [(1, 8, 8), (1, 8, 12)]}])
    ids = feats["input_ids"]
    pos = int((ids[1] == SMALL_IDS.image).nonzero()[-1])  # drop the last placeholder of sample 1
    keep = torch.ones(ids.shape[1], dtype=torch.bool)
    keep[pos] = False
    for k in ("input_ids", "attention_mask", "mm_token_type_ids"):
        row = feats[k][1][keep]
        feats[k] = feats[k].clone()
        feats[k][1] = torch.cat([row, row.new_zeros(1)])
    with pytest.raises(ValueError, match=r"sample 1 has 39 image placeholder tokens but its 2 images give 40 visual tokens \(grids \[1, 8, 8\], \[1, 8, 12\]\)"):
        RaggedBatch.from_features(feats, token_ids=SMALL_IDS)


@pytest.mark.parametrize("drop", [0, 1, 2])
def test_one_grid_row_removed_raises_naming_the_sample(drop):
    feats = make_features([{"images": [G224, G28]}, {"text": 2}, {"images": [(1, 8, 12)]}])
    rows = feats["image_grid_thw"].prod(dim=1)
    keep = [i for i in range(3) if i != drop]
    start = [0, *rows.cumsum(0).tolist()]
    feats["pixel_values"] = torch.cat([feats["pixel_values"][start[i] : start[i + 1]] for i in keep])
    feats["image_grid_thw"] = feats["image_grid_thw"][keep]
    owner = [0, 0, 2][drop]
    with pytest.raises(ValueError, match=rf"sample {owner} has \d+ image placeholder tokens"):
        RaggedBatch.from_features(feats, token_ids=SMALL_IDS)
    # explicit counts that disagree with the grid rows are also rejected, naming the sample
    with pytest.raises(ValueError, match=rf"sample {owner} has \d+ image placeholder tokens for \d images"):
        RaggedBatch.from_features(feats, image_counts=[2, 0, 1], token_ids=SMALL_IDS)


def test_patch_rows_vs_grid_products():
    feats = three_samples()
    feats["pixel_values"] = feats["pixel_values"][:-4]
    with pytest.raises(ValueError, match=r"pixel_values has 352 patch rows but the image_grid_thw products sum to 356"):
        RaggedBatch.from_features(feats, token_ids=SMALL_IDS)


@pytest.mark.parametrize("bad, why", [((1, 0, 4), "positive"), ((1, 3, 4), "multiples of merge_size 2"), ((-1, 4, 4), "positive")])
def test_bad_grids(bad, why):
    feats = three_samples()
    feats["image_grid_thw"] = feats["image_grid_thw"].clone()
    feats["image_grid_thw"][2] = torch.tensor(bad)
    with pytest.raises(ValueError, match=rf"image 2 \(sample 2\) has grid \[{bad[0]}, {bad[1]}, {bad[2]}\].*{re.escape(why)}"):
        RaggedBatch.from_features(feats, image_counts=[2, 0, 1], token_ids=SMALL_IDS)
    with pytest.raises(ValueError, match=rf"image 2 has grid \[{bad[0]}, {bad[1]}, {bad[2]}\]"):
        RaggedBatch.from_features(feats, token_ids=SMALL_IDS)  # ownership not derived yet


def test_mm_token_type_ids_must_mark_placeholders():
    feats = three_samples()
    feats["mm_token_type_ids"] = feats["mm_token_type_ids"].clone()
    feats["mm_token_type_ids"][2, 3] = 0
    with pytest.raises(ValueError, match=r"sample 2, token 3: mm_token_type_ids marks 23 image tokens but input_ids has 24"):
        RaggedBatch.from_features(feats, token_ids=SMALL_IDS)


def test_run_without_vision_start_is_rejected():
    feats = three_samples()
    feats["input_ids"] = feats["input_ids"].clone()
    feats["input_ids"][2, 1] = 11  # the <|vision_start|> before sample 2's image
    with pytest.raises(ValueError, match=r"sample 2: the image placeholder run at token 2 is not preceded by <\|vision_start\|>"):
        RaggedBatch.from_features(feats, token_ids=SMALL_IDS)


def test_shape_and_key_errors():
    feats = three_samples()
    with pytest.raises(ValueError, match=r"keys \['pixel_attention_mask'\] are not part of layout 'qwen2_vl'"):
        RaggedBatch.from_features({**feats, "pixel_attention_mask": torch.ones(3)}, token_ids=SMALL_IDS)
    with pytest.raises(ValueError, match=r"attention_mask has shape \[2, \d+\] but input_ids is \[3, \d+\]"):
        RaggedBatch.from_features({**feats, "attention_mask": feats["attention_mask"][:2]}, token_ids=SMALL_IDS)
    with pytest.raises(ValueError, match="image_grid_thw is present but pixel_values is missing"):
        RaggedBatch.from_features({k: v for k, v in feats.items() if k != "pixel_values"}, token_ids=SMALL_IDS)
    with pytest.raises(ValueError, match=r"must be \[P, 1536\] for layout qwen3_vl"):
        RaggedBatch.from_features(feats, "qwen3_vl", token_ids=SMALL_IDS)
    with pytest.raises(ValueError, match="unknown layout 'llava'"):
        RaggedBatch.from_features(feats, "llava", token_ids=SMALL_IDS)
    with pytest.raises(ValueError, match="image_counts has 2 entries for 3 samples"):
        RaggedBatch.from_features(feats, image_counts=[2, 1], token_ids=SMALL_IDS)
    batch = RaggedBatch.from_features(feats, token_ids=SMALL_IDS)
    with pytest.raises(ValueError, match=r"split sizes \[1, 1\] must be >= 0 and sum to the 3 samples"):
        batch.split([1, 1])
    with pytest.raises(ValueError, match="out of range for a batch of 3 samples"):
        batch.select([3])


def test_token_ids_from_processor_like_objects_and_defaults():
    class Tok:
        image_token_id, video_token_id, vision_start_token_id = 7, 8, 5

    class Proc:
        tokenizer = Tok()

    assert TokenIds.from_any(Proc()) == SMALL_IDS
    assert TokenIds.from_any(None) == TokenIds(151652, 151655, 151656)
    feats = make_features([{"images": [G28]}], ids=TokenIds())  # public Qwen ids
    assert RaggedBatch.from_features(feats).image_counts == [1]
    assert RaggedBatch.from_features(three_samples(), token_ids=Proc()).image_counts == [2, 0, 1]


def test_qwen3_videos_are_one_run_per_frame_and_own_their_grids():
    samples = [{"videos": [(3, 4, 4)], "images": [G28]}, {"text": 2}, {"videos": [(1, 2, 2), (2, 4, 2)]}]
    feats = make_features(samples, "qwen3_vl")
    batch = RaggedBatch.from_features(feats, "qwen3_vl", token_ids=SMALL_IDS)
    assert batch.video_counts == [1, 0, 2] and batch.image_counts == [1, 0, 0]
    sel = batch.select([2])
    assert sel["video_grid_thw"].tolist() == [[1, 2, 2], [2, 4, 2]]
    assert torch.equal(sel["pixel_values_videos"], batch["pixel_values_videos"][48:])
    # the same tokens read as Qwen2-VL (one run per video) cannot be matched to the grids
    with pytest.raises(ValueError, match="sample 0 has 12 video placeholder tokens for 3 videos"):
        RaggedBatch.from_features({**feats, "pixel_values": feats["pixel_values"][:, :1176],
                                   "pixel_values_videos": feats["pixel_values_videos"][:, :1176]},
                                  "qwen2_vl", token_ids=SMALL_IDS)


def test_qwen2_5_second_per_grid_ts_follows_its_video():
    feats = make_features([{"videos": [(2, 4, 4)]}, {"images": [G28]}, {"videos": [(2, 2, 2)]}], "qwen2_5_vl")
    batch = RaggedBatch.from_features(feats, "qwen2_5_vl", token_ids=SMALL_IDS)
    sel = batch.select([2, 1])
    assert torch.equal(sel["second_per_grid_ts"], feats["second_per_grid_ts"][[1]])
    assert "second_per_grid_ts" not in batch.select([1]).keys()


def test_concat_pads_different_lengths_and_to_moves_everything():
    a = RaggedBatch.from_features(make_features([{"images": [G28]}], labels=True, mrope=True), token_ids=SMALL_IDS)
    b = RaggedBatch.from_features(make_features([{"images": [(1, 4, 4)], "text": 9}], labels=True, mrope=True), token_ids=SMALL_IDS)
    c = RaggedBatch.concat([a, b], pad_token_id=0)
    c.validate()
    L = b["input_ids"].shape[1]
    assert c["input_ids"].shape == (2, L) and c["position_ids"].shape == (3, 2, L)
    assert (c["labels"][0, a["input_ids"].shape[1]:] == -100).all()
    assert (c["attention_mask"][0, a["input_ids"].shape[1]:] == 0).all()
    for j, src in enumerate([a, b]):
        got, want = per_sample_parts(c, j), per_sample_parts(src, 0)
        assert torch.equal(got["pixel_values"], want["pixel_values"])
    moved = c.to("cpu", non_blocking=True)
    assert moved.image_counts == c.image_counts and all(torch.equal(moved[k], c[k]) for k in c.keys())

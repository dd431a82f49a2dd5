"""RaggedBatch on real processor output: transformers' Qwen2VLProcessor (PIL image processor,
the project's offline tiny tokenizer) returning a ``BatchFeature``."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from raggedvl.batch import RaggedBatch, TokenIds

IMG = "<|vision_start|><|image_pad|><|vision_end|>"


@pytest.fixture(scope="module")
def processor():
    from raggedvl.data import build_processor

    return build_processor("tiny")


def test_processor_batch_feature_round_trips(processor):
    images = [Image.new("RGB", (448, 448), "white"), Image.new("RGB", (300, 60), "gray"), Image.new("RGB", (90, 200))]
    texts = [IMG + "a full page", "a text-only query", IMG + " left " + IMG + " right"]
    feats = processor(text=texts, images=images, return_tensors="pt", padding=True)
    ids = TokenIds.from_any(processor)
    assert ids.image == processor.image_token_id
    assert processor.tokenizer.convert_ids_to_tokens(ids.vision_start) == "<|vision_start|>"
    batch = RaggedBatch.from_features(feats, token_ids=processor)
    assert batch.image_counts == [1, 0, 2]
    assert batch.keys() == list(feats.keys())
    grids = feats["image_grid_thw"]
    sel = batch.select([2, 0])
    assert torch.equal(sel["image_grid_thw"], grids[[1, 2, 0]])
    rows = grids.prod(dim=1).tolist()
    assert torch.equal(sel["pixel_values"], torch.cat([feats["pixel_values"][rows[0]:], feats["pixel_values"][: rows[0]]]))
    assert "pixel_values" not in batch.select([1]).keys()
    back = RaggedBatch.from_padded(batch.to_padded(), token_ids=processor)
    assert torch.equal(back["pixel_values"], feats["pixel_values"])
    # placeholders cut after processing (a collator truncating input_ids) are caught, naming the sample
    is_pad = feats["input_ids"] == processor.image_token_id
    cut_at = int(is_pad[0].nonzero()[-1])  # drops the last placeholder of sample 0
    first_hit = int((is_pad[:, cut_at:].sum(dim=1) > 0).nonzero()[0])
    cut = {k: (v[:, :cut_at] if k in ("input_ids", "attention_mask", "mm_token_type_ids") else v) for k, v in feats.items()}
    with pytest.raises(ValueError, match=rf"sample {first_hit} has \d+ image placeholder tokens but its \d images give"):
        RaggedBatch.from_features(cut, token_ids=processor)

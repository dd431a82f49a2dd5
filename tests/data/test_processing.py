"""Processors: the offline tiny tokenizer, placeholder expansion, real-checkpoint loading path."""

from __future__ import annotations

import pytest
import torch
from PIL import Image
from transformers import Qwen2VLProcessor

from raggedvl.data import QWEN2_VL_SPECIAL_TOKENS, TINY_MAX_PIXELS, build_processor, set_pixel_limits
from raggedvl.data.processing import train_tiny_tokenizer

TEXTS = ["Sample quantiles of a numeric vector.", "Kernel density estimation for the data x <- c(1, 2)."] * 40


def test_tokenizer_training_is_deterministic_and_qwen_shaped():
    first = train_tiny_tokenizer(TEXTS, vocab_size=400)
    second = train_tiny_tokenizer(TEXTS, vocab_size=400)
    assert first.get_vocab() == second.get_vocab()
    assert first.backend_tokenizer.to_str() == second.backend_tokenizer.to_str()
    ids = first.convert_tokens_to_ids(list(QWEN2_VL_SPECIAL_TOKENS))
    assert ids == list(range(len(QWEN2_VL_SPECIAL_TOKENS)))
    assert first.pad_token == "<|endoftext|>" and first.pad_token_id == 0
    text = "Query: quantiles<|vision_start|><|image_pad|><|image_pad|><|vision_end|>"
    tokens = first.convert_ids_to_tokens(first(text)["input_ids"])
    assert tokens[-4:] == ["<|vision_start|>", "<|image_pad|>", "<|image_pad|>", "<|vision_end|>"]  # never split
    assert first.decode(first("naïve café x <- 1")["input_ids"]) == "naïve café x <- 1"  # byte-level round trip
    with pytest.raises(ValueError, match="vocab_size"):
        train_tiny_tokenizer(TEXTS, vocab_size=100)


def test_tiny_processor_expands_placeholders(tiny_processor):
    proc = tiny_processor
    assert isinstance(proc, Qwen2VLProcessor)
    assert len(proc.tokenizer) == 4096
    assert proc.image_processor.size["longest_edge"] == TINY_MAX_PIXELS
    images = [Image.new("RGB", (448, 448), (200, 10, 10)), Image.new("RGB", (224, 112), (0, 0, 0))]
    text = ["<|vision_start|><|image_pad|><|vision_end|>Describe the image.", "<|vision_start|><|image_pad|><|vision_end|>x"]
    out = proc(text=text, images=images, padding="longest", return_tensors="pt")
    assert out["image_grid_thw"].tolist() == [[1, 32, 32], [1, 8, 16]]  # CASES.md: 448x448 -> [1,32,32]
    assert out["pixel_values"].shape == (1024 + 128, 1176)
    image_id = proc.image_token_id
    per_sample = (out["input_ids"] == image_id).sum(dim=1).tolist()
    assert per_sample == [256, 32]  # t*h*w / merge_size**2
    assert torch.equal(out["mm_token_type_ids"] == 1, out["input_ids"] == image_id)
    with pytest.raises(ValueError, match="video"):
        proc(text=["<|vision_start|><|video_pad|><|vision_end|>"], videos=[[images[0]]])


def test_processor_from_a_local_checkpoint_directory(tiny_processor, tmp_path, data_cache):
    tiny_processor.save_pretrained(tmp_path)
    loaded = build_processor(str(tmp_path), min_pixels=28 * 28, max_pixels=100_352, cache_dir=data_cache)
    assert isinstance(loaded, Qwen2VLProcessor)
    assert loaded.tokenizer.get_vocab() == tiny_processor.tokenizer.get_vocab()
    out = loaded(text=["<|vision_start|><|image_pad|><|vision_end|>"], images=[Image.new("RGB", (1000, 1000))], return_tensors="pt")
    _, h, w = out["image_grid_thw"][0].tolist()
    assert h * w * 14 * 14 <= 100_352
    with pytest.raises(ValueError, match="cannot load a processor"):
        build_processor(str(tmp_path / "missing-dir"))


def test_set_pixel_limits_rejects_inverted_range(tiny_processor):
    with pytest.raises(ValueError, match="above max_pixels"):
        set_pixel_limits(tiny_processor, 10**7, None)
    assert tiny_processor.image_processor.size["shortest_edge"] == 56 * 56  # unchanged after the error


def test_a_stand_in_processor_carries_the_checkpoints_model_type(tmp_path, tiny_processor):
    """The PIL stand-in for a checkpoint's processor resolves to the family its config.json
    states (raggedvl.families.family_of), not to the stand-in's class; no config -> its class."""
    import json

    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from raggedvl.data.processing import _image_text_processor, checkpoint_model_type
    from raggedvl.families import family_of

    plain, qwen3, colqwen = tmp_path / "plain", tmp_path / "qwen3", tmp_path / "colqwen"
    for folder, config in ((qwen3, {"model_type": "qwen3_vl"}),
                           (colqwen, {"model_type": "colqwen2", "vlm_config": {"model_type": "qwen2_5_vl"}})):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config))
    plain.mkdir()
    assert [checkpoint_model_type(str(p)) for p in (plain, qwen3, colqwen)] == [None, "qwen3_vl", "qwen2_5_vl"]
    patch16 = Qwen2VLImageProcessorPil(patch_size=16)
    assert family_of(_image_text_processor(str(qwen3), patch16, tiny_processor.tokenizer)).name == "qwen3_vl"
    patch14 = tiny_processor.image_processor
    assert family_of(_image_text_processor(str(colqwen), patch14, tiny_processor.tokenizer)).name == "qwen2_5_vl"
    assert family_of(_image_text_processor(str(plain), patch14, tiny_processor.tokenizer)).name == "qwen2_vl"

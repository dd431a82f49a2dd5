"""Loading real-checkpoint layouts: a Qwen2VLForConditionalGeneration directory written by
transformers (current key layout) and the legacy layout of hub checkpoints such as
Qwen/Qwen2-VL-2B-Instruct (``model.layers.*``, ``visual.*``, ``lm_head``): the retriever's base
model receives every weight, ``lm_head`` is dropped, and an incomplete checkpoint is refused."""

import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import Qwen2VLForConditionalGeneration

from raggedvl.models import TinySizes, build_retriever, tiny_backbone_config
from tests.models.helpers import tiny_tokenizer

SIZES = TinySizes(hidden_size=64, num_layers=1, intermediate_size=64, vision_depth=1, vision_embed_dim=32,
                  vision_heads=2)


@pytest.fixture(scope="module")
def generation_model():
    torch.manual_seed(0)
    return Qwen2VLForConditionalGeneration(tiny_backbone_config(tiny_tokenizer(), "qwen2_vl", SIZES))


def _legacy_dir(model, path, drop=()):
    path.mkdir()
    model.config.to_json_file(path / "config.json")
    tensors = {}
    for key, value in model.state_dict().items():
        key = key.replace("model.language_model.", "model.").replace("model.visual.", "visual.")
        if key not in drop:
            tensors[key] = value.contiguous()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


def _assert_same_base(retriever, model):
    base = retriever.base_model.state_dict()
    expected = model.model.state_dict()
    assert base.keys() == expected.keys()
    assert all(torch.equal(base[k], v) for k, v in expected.items())


def test_current_layout_loads_every_base_weight(generation_model, tmp_path):
    generation_model.save_pretrained(tmp_path / "ckpt")
    retriever = build_retriever(str(tmp_path / "ckpt"), processor=tiny_tokenizer(), dim=32)
    _assert_same_base(retriever, generation_model)
    assert retriever.config.source == str(tmp_path / "ckpt") and retriever.head.proj.out_features == 32


def test_legacy_hub_layout_loads_every_base_weight(generation_model, tmp_path):
    retriever = build_retriever(str(_legacy_dir(generation_model, tmp_path / "legacy")))
    _assert_same_base(retriever, generation_model)


def test_incomplete_or_foreign_checkpoints_are_refused(generation_model, tmp_path):
    broken = _legacy_dir(generation_model, tmp_path / "broken", drop=("visual.merger.mlp.0.weight",))
    with pytest.raises(ValueError, match="uninitialised"):
        build_retriever(str(broken))
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ValueError, match="not a supported backbone"):
        build_retriever(str(foreign))

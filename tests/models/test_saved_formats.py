"""Saved retrievers cannot be mistaken: a LoRA retriever on a named base saves its adapters and
head only (the base reloads from its checkpoint, checked), the files are not called
``config.json`` / ``model.safetensors`` (so transformers refuses the folder at once instead of
building its default 80-layer model), files follow the umask, and folders from before the
rename still load."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file
from transformers import Qwen2VLForConditionalGeneration

from raggedvl.models import LoraSettings, Retriever, TinySizes, build_retriever, tiny_backbone_config
from raggedvl.prompts import LEGACY_PROMPTS
from tests.models.helpers import tiny_tokenizer

SIZES = TinySizes(hidden_size=64, num_layers=1, intermediate_size=64, vision_depth=1, vision_embed_dim=32, vision_heads=2)
LORA = LoraSettings(r=4, alpha=8, dropout=0.0)


def _backbone_checkpoint(path, sizes=SIZES, seed=0):
    torch.manual_seed(seed)
    Qwen2VLForConditionalGeneration(tiny_backbone_config(tiny_tokenizer(), "qwen2_vl", sizes)).save_pretrained(path)
    return path


def _ids():
    return {"input_ids": torch.tensor([[5, 6, 7, 8], [9, 10, 11, 0]]), "attention_mask": torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])}


def _perturbed_lora_retriever(base):
    model = build_retriever(str(base), lora=LORA)
    with torch.no_grad():  # move the trainable weights away from their init
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.05)
    return model


def test_lora_on_a_named_base_saves_adapters_and_head_only(tmp_path):
    base = _backbone_checkpoint(tmp_path / "base")
    model = _perturbed_lora_retriever(base)
    assert model.config.base == str(base.resolve())
    model.save_pretrained(tmp_path / "saved")
    saved = load_file(str(tmp_path / "saved" / "raggedvl_retriever.safetensors"))
    assert set(saved) == {n for n, p in model.named_parameters() if p.requires_grad}
    assert (tmp_path / "saved" / "raggedvl_retriever.safetensors").stat().st_size < (base / "model.safetensors").stat().st_size / 2
    meta = json.loads((tmp_path / "saved" / "raggedvl_retriever.json").read_text())
    assert meta["weights"] == "trainable"
    loaded = build_retriever(str(tmp_path / "saved"))
    assert loaded.state_dict().keys() == model.state_dict().keys()
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in model.state_dict().items())
    assert torch.equal(loaded.eval()(**_ids()).embeddings, model.eval()(**_ids()).embeddings)
    with pytest.raises(ValueError, match="holds only the trainable weights.*build_retriever"):
        Retriever.from_pretrained(tmp_path / "saved")


def test_a_changed_base_is_refused_naming_the_size(tmp_path):
    base = _backbone_checkpoint(tmp_path / "base")
    _perturbed_lora_retriever(base).save_pretrained(tmp_path / "saved")
    wider = TinySizes(hidden_size=128, num_layers=1, intermediate_size=64, vision_depth=1, vision_embed_dim=32, vision_heads=2)
    _backbone_checkpoint(tmp_path / "base", sizes=wider)  # the base checkpoint was replaced by another model
    with pytest.raises(ValueError, match=r"raggedvl_retriever\.json: the adapters were trained on a base with "
                                         r"text_config\.hidden_size = 64, but the base .* has 128"):
        build_retriever(str(tmp_path / "saved"))


def test_tiny_lora_and_merged_retrievers_save_in_full(tmp_path):
    tiny = build_retriever("tiny", processor=tiny_tokenizer(), tiny_sizes=SIZES, lora=LORA)
    assert tiny.config.base is None and not tiny.saves_trainable_only  # a random base no checkpoint holds
    tiny.save_pretrained(tmp_path / "tiny")
    assert set(load_file(str(tmp_path / "tiny" / "raggedvl_retriever.safetensors"))) == set(tiny.state_dict())
    merged = _perturbed_lora_retriever(_backbone_checkpoint(tmp_path / "base"))
    before = merged.eval()(**_ids()).embeddings
    merged.merge_lora()
    assert merged.config.lora is None and merged.config.base is None
    assert torch.allclose(merged(**_ids()).embeddings, before, atol=1e-6)


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077])
def test_saved_files_follow_the_umask(tmp_path, umask):
    model = build_retriever("tiny", processor=tiny_tokenizer(), tiny_sizes=SIZES)
    old = os.umask(umask)
    try:
        model.save_pretrained(tmp_path)
    finally:
        os.umask(old)
    for name in ("raggedvl_retriever.safetensors", "raggedvl_retriever.json"):
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o666 & ~umask, name


def test_transformers_refuses_a_saved_retriever_at_once(tmp_path):
    """Given model.safetensors, ColQwen2ForRetrieval.from_pretrained builds its default 80-layer
    model whatever config.json says (measured: out of memory); raggedvl's file names stop it
    before it builds anything."""
    from transformers import AutoConfig, ColQwen2ForRetrieval

    build_retriever("tiny", processor=tiny_tokenizer(), tiny_sizes=SIZES).save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["raggedvl_retriever.json", "raggedvl_retriever.safetensors"]
    with pytest.raises(OSError, match="no file named model.safetensors"):
        ColQwen2ForRetrieval.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="model_type"):
        AutoConfig.from_pretrained(tmp_path)


def test_a_folder_saved_before_the_rename_still_loads_with_its_prompts(tmp_path):
    model = build_retriever("tiny", processor=tiny_tokenizer(), tiny_sizes=SIZES, seed=0)
    model.save_pretrained(tmp_path)
    meta = json.loads((tmp_path / "raggedvl_retriever.json").read_text())
    del meta["retriever"]["prompts"], meta["retriever"]["base"], meta["weights"]  # as older raggedvl wrote it
    (tmp_path / "config.json").write_text(json.dumps(meta))
    (tmp_path / "raggedvl_retriever.json").unlink()
    (tmp_path / "raggedvl_retriever.safetensors").rename(tmp_path / "model.safetensors")
    loaded = build_retriever(str(tmp_path))
    assert loaded.config.prompts == LEGACY_PROMPTS  # trained with the "Query: " prefix
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in model.state_dict().items())

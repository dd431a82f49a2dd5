"""``RaggedTrainer.save_model`` writes a retriever that ``build_retriever`` loads (processor
beside it, training arguments as JSON, no pickle), and resuming from it loads the weights back
(the stock Trainer wrote ``model.safetensors`` + ``training_args.bin``, which neither
``build_retriever`` nor transformers could load as a retriever)."""

from __future__ import annotations

import json

import pytest
import torch

from raggedvl.data import build_processor
from raggedvl.hf import RaggedTrainer
from raggedvl.models import build_retriever
from tests.hf.helpers import tiny_processor, tiny_retriever, training_args


@pytest.fixture
def no_unpickling(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("torch.load reached while loading a saved retriever")

    monkeypatch.setattr(torch, "load", refuse)


def test_save_model_writes_a_loadable_retriever_with_its_processor(tmp_path, no_unpickling):
    model = tiny_retriever(dtype=torch.float32)
    trainer = RaggedTrainer(model, training_args(tmp_path / "out"), processor=tiny_processor())
    trainer.save_model(str(tmp_path / "saved"))
    names = {p.name for p in (tmp_path / "saved").iterdir()}
    assert {"raggedvl_retriever.json", "raggedvl_retriever.safetensors", "tokenizer.json", "processor_config.json",
            "training_args.json"} <= names
    assert not names & {"training_args.bin", "model.safetensors", "config.json"}
    assert json.loads((tmp_path / "saved" / "training_args.json").read_text())["output_dir"] == str(tmp_path / "out")
    loaded = build_retriever(str(tmp_path / "saved"))
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in model.state_dict().items())
    assert build_processor(str(tmp_path / "saved")).tokenizer.get_vocab() == tiny_processor().tokenizer.get_vocab()


def test_resuming_from_a_saved_retriever_loads_its_weights(tmp_path, no_unpickling):
    saved = tiny_retriever(dtype=torch.float32)
    with torch.no_grad():
        for p in saved.parameters():
            p.add_(0.01)
    RaggedTrainer(saved, training_args(tmp_path / "a"), processor=tiny_processor()).save_model(str(tmp_path / "ckpt"))
    fresh = tiny_retriever(dtype=torch.float32)
    RaggedTrainer(fresh, training_args(tmp_path / "b"), processor=tiny_processor())._load_from_checkpoint(str(tmp_path / "ckpt"))
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in saved.state_dict().items())


def test_save_model_of_a_colpali_adapter_holds_the_adapters_and_head_and_loads_back(tmp_path, no_unpickling):
    from safetensors.torch import load_file

    from tests.models.interop.helpers import FULL, LORA

    model = build_retriever(str(LORA))  # colpali's LoRA adapter, kept trainable on its base
    trainer = RaggedTrainer(model, training_args(tmp_path / "out"), processor=build_processor(str(LORA)))
    trainer.save_model(str(tmp_path / "saved"))
    saved = load_file(str(tmp_path / "saved" / "raggedvl_retriever.safetensors"))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert set(saved) == trainable and all("lora_" in k or k.startswith("head.") for k in saved)  # no frozen base
    loaded = build_retriever(str(tmp_path / "saved"))  # reloads the base named in its settings
    assert loaded.config.base == str(FULL.resolve())
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in model.state_dict().items())

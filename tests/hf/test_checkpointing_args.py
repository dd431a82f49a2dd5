"""The Trainer's own activation-checkpointing arguments work with a retriever: full and LoRA,
non-reentrant and reentrant, the run's weights equal those of the run without checkpointing.
float64 tiny model on CPU: the recompute repeats the same operations on the same values, so the
weights agree to float64 rounding of the backward's summation order (1e-10 here)."""

from __future__ import annotations

import pytest
import torch

from raggedvl.data import RetrievalCollator
from raggedvl.hf import RaggedTrainer, RetrievalWireCollator
from raggedvl.models import LoraSettings
from tests.hf.helpers import retrieval_examples, tiny_processor, tiny_retriever, trainable, training_args


def _train(tmp_path, lora, **checkpointing):
    model = tiny_retriever(lora=lora)
    before = trainable(model)
    trainer = RaggedTrainer(model, training_args(tmp_path, **checkpointing), processor=tiny_processor(),
                            train_dataset=retrieval_examples(8), data_collator=RetrievalWireCollator(RetrievalCollator(tiny_processor())))
    trainer.train()
    return model, before, trainable(model)


@pytest.mark.parametrize("lora", [None, LoraSettings(r=4, alpha=4, dropout=0.0)], ids=["full", "lora"])
@pytest.mark.parametrize("checkpointing", [
    dict(gradient_checkpointing=True),
    dict(gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": True}),
    dict(activation_checkpointing=True),
], ids=["gradient_checkpointing", "reentrant", "activation_checkpointing"])
def test_checkpointing_flags_train_the_same_weights(tmp_path, lora, checkpointing):
    _, before, plain = _train(tmp_path / "plain", lora)
    model, _, checked = _train(tmp_path / "checked", lora, **checkpointing)
    assert model.is_gradient_checkpointing and model.is_activation_checkpointing
    assert plain.keys() == checked.keys()
    moved = [n for n in plain if not torch.equal(plain[n], before[n])]
    assert moved and (lora is None or all("lora_" in n or "head" in n for n in plain))  # adapters trained
    for name in plain:
        torch.testing.assert_close(checked[name], plain[name], rtol=0, atol=1e-10, msg=name)


def _best_run(tmp_path, lora, callbacks=()):
    model = tiny_retriever(lora=lora)
    args = training_args(tmp_path, max_steps=4, save_strategy="steps", save_steps=1, eval_strategy="steps", eval_steps=1,
                         load_best_model_at_end=True, metric_for_best_model="eval_loss",
                         greater_is_better=True)  # the highest loss: an early checkpoint, not the last weights
    trainer = RaggedTrainer(model, args, processor=tiny_processor(), train_dataset=retrieval_examples(8),
                            eval_dataset=retrieval_examples(6), callbacks=list(callbacks),
                            data_collator=RetrievalWireCollator(RetrievalCollator(tiny_processor())))
    trainer.train()
    return trainer, model


@pytest.mark.parametrize("lora", [None, LoraSettings(r=4, alpha=4, dropout=0.0)], ids=["full", "lora"])
def test_load_best_model_at_end_restores_the_best_checkpoint(tmp_path, lora):
    from safetensors.torch import load_file

    from raggedvl.models.saved import weights_file

    trainer, model = _best_run(tmp_path, lora)
    best = trainer.state.best_model_checkpoint
    assert best is not None and not best.endswith(f"checkpoint-{trainer.state.global_step}")
    saved = load_file(str(weights_file(best)))
    state = model.state_dict()
    assert saved and all(torch.equal(state[k], v) for k, v in saved.items())
    assert trainer.evaluate()["eval_loss"] == pytest.approx(trainer.state.best_metric, rel=1e-12)


def test_early_stopping_ends_on_the_best_weights(tmp_path):
    from transformers import EarlyStoppingCallback

    trainer, _ = _best_run(tmp_path, None, callbacks=[EarlyStoppingCallback(early_stopping_patience=1)])
    assert trainer.state.global_step < 4  # it stopped early
    assert trainer.evaluate()["eval_loss"] == pytest.approx(trainer.state.best_metric, rel=1e-12)

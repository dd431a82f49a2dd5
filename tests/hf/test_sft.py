"""Generative fine-tuning through RaggedSFTTrainer: label masking, placeholder alignment, one exact
step on multi-image samples, LoRA."""

from __future__ import annotations

import pytest
import torch

from raggedvl.batch import TokenIds
from raggedvl.hf import IGNORE_INDEX, RaggedSFTTrainer, SFTCollator, apply_generation_lora, unpack
from raggedvl.models import LoraSettings
from tests.hf.helpers import sft_examples, tiny_generator, tiny_processor, training_args

LR = 0.5


def _batch(examples):
    proc = tiny_processor()
    return unpack(SFTCollator(proc)(examples), token_ids=TokenIds.from_any(proc), pad_token_id=proc.tokenizer.pad_token_id)


def test_labels_cover_exactly_the_answer_and_placeholders_match_grids():
    proc = tiny_processor()
    examples = sft_examples()
    batch = _batch(examples)
    ids = TokenIds.from_any(proc)
    assert batch.image_counts == [len(ex["images"]) for ex in examples]
    grids = batch["image_grid_thw"]
    start = 0
    for b, ex in enumerate(examples):
        tokens = batch["input_ids"][b]
        mine = grids[start:start + len(ex["images"])]
        start += len(ex["images"])
        assert int((tokens == ids.image).sum()) == int(mine.prod(dim=1).sum()) // 4
        assert int((tokens == ids.vision_start).sum()) == len(ex["images"])
        labels = batch["labels"][b]
        trained = labels != IGNORE_INDEX
        assert not trained[tokens == ids.image].any()
        assert not trained[batch["attention_mask"][b] == 0].any()
        # the assistant turn after its header, as the processor's chat template writes it
        assert proc.tokenizer.decode(labels[trained]) == ex["answer"] + "<|im_end|>\n"
        assert torch.equal(labels[trained], tokens[trained])
        if ex["images"]:  # the answer comes after every placeholder
            assert int(trained.nonzero().min()) > int((tokens == ids.image).nonzero().max())


def test_prompts_come_from_the_processors_chat_template():
    import copy

    proc = copy.deepcopy(tiny_processor())
    template = proc.chat_template
    proc.chat_template = "<|im_start|>system\nbe brief<|im_end|>\n" + template  # a template with a system turn
    batch = unpack(SFTCollator(proc)(sft_examples()[1:2]), token_ids=TokenIds.from_any(proc), pad_token_id=proc.tokenizer.pad_token_id)
    tokens = batch["input_ids"][0][batch["attention_mask"][0].bool()]
    assert proc.tokenizer.decode(tokens) == ("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nsay hello<|im_end|>\n"
                                             "<|im_start|>assistant\nhello<|im_end|>\n")
    labels = batch["labels"][0][batch["attention_mask"][0].bool()]
    assert proc.tokenizer.decode(labels[labels != IGNORE_INDEX]) == "hello<|im_end|>\n"
    # a template whose assistant header differs from its generation prompt: the answer cannot be located
    proc.chat_template = template.replace("<|im_start|>{{ message['role'] }}", "<|im_start|>[{{ message['role'] }}]")
    with pytest.raises(ValueError, match="generation prompt"):
        SFTCollator(proc)(sft_examples()[1:2])
    proc.chat_template = None
    with pytest.raises(ValueError, match="has no chat template"):
        SFTCollator(proc)(sft_examples()[1:2])


def test_too_long_sample_is_refused_not_truncated():
    with pytest.raises(ValueError, match="SFT example 0 has .* max_length is 20"):
        SFTCollator(tiny_processor(), max_length=20)(sft_examples()[:1])


def test_one_trainer_step_is_the_models_own_step(tmp_path):
    """Loss = the model's causal-LM token mean on the multi-image batch; weights after one SGD
    step equal a manual step (float64)."""
    examples = sft_examples()
    batch = _batch(examples)
    reference = tiny_generator()
    loss = reference(**batch.to_dict(), use_cache=False).loss
    loss.backward()
    with torch.no_grad():
        expected = {n: p - LR * p.grad for n, p in reference.named_parameters()}
    model = tiny_generator()
    args = training_args(tmp_path, per_device_train_batch_size=3, max_steps=1, learning_rate=LR)
    assert args.remove_unused_columns  # the default: the ragged collator must survive it
    trainer = RaggedSFTTrainer(model, args, processor=tiny_processor(), train_dataset=examples,
                            data_collator=SFTCollator(tiny_processor()))
    trainer.train()
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert logged == pytest.approx([loss.item()], rel=1e-6)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), expected[n], rtol=0, atol=1e-10, msg=n)


@pytest.mark.parametrize("batch_size", [1, 2, 3])
def test_evaluate_reports_the_token_mean_of_the_eval_set(tmp_path, batch_size):
    """Answers of different lengths: the loss is the mean over every label token of the set (as
    training normalises it), not a mean of per-batch means, so the batch size does not change it."""
    examples = sft_examples()
    model = tiny_generator()
    trainer = RaggedSFTTrainer(model, training_args(tmp_path, per_device_eval_batch_size=batch_size),
                            processor=tiny_processor(), eval_dataset=examples,
                            data_collator=SFTCollator(tiny_processor()))
    metrics = trainer.evaluate()
    sums = tokens = 0.0
    with torch.no_grad():  # float64 model: each example's summed token loss, then one mean
        for example in examples:
            batch = _batch([example])
            n = batch["labels"][..., 1:].ne(-100).sum().item()
            sums += model(**batch.to_dict(), use_cache=False).loss.item() * n
            tokens += n
    assert metrics["eval_loss"] == pytest.approx(sums / tokens, rel=1e-6)  # the loss is reported in float32


def test_lora_sft_trains_only_adapters(tmp_path):
    model = apply_generation_lora(tiny_generator(), LoraSettings(r=4, alpha=8, dropout=0.0))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert not any("visual" in n for n in trainable)
    targets = LoraSettings().target_modules  # the retriever's rule: every LM projection, nothing else
    expected = {f"base_model.model.{n}" for n, m in tiny_generator().named_modules()
                if isinstance(m, torch.nn.Linear) and ".language_model." in f".{n}" and n.rsplit(".", 1)[-1] in targets}
    assert {n.split(".lora_")[0] for n in trainable} == expected
    with pytest.raises(ValueError, match="match no Linear of Qwen2VLForConditionalGeneration's language model"):
        apply_generation_lora(tiny_generator(), LoraSettings(target_modules=("qkv",)))
    trainer = RaggedSFTTrainer(model, training_args(tmp_path, per_device_train_batch_size=3, max_steps=1),
                            processor=tiny_processor(), train_dataset=sft_examples(),
                            data_collator=SFTCollator(tiny_processor()))
    trainer.train()
    changed = {n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])}
    assert changed and changed <= trainable
    assert any("lora_B" in n for n in changed)  # B starts at zero; its first step is the one that moves

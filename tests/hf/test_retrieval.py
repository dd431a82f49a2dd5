"""Contrastive retrieval through RaggedTrainer in one process: exact loss and step, gradient
accumulation, the DataParallel path, LoRA, argument errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import IterableDataset

from raggedvl.data import RetrievalCollator
from raggedvl.hf import RaggedSFTTrainer, RaggedTrainer, RetrievalWireCollator, SFTCollator
from raggedvl.losses import InfoNCELoss, LateInteractionLoss
from raggedvl.models import LoraSettings
from raggedvl.parallel import RaggedDataParallel
from tests.hf.helpers import retrieval_examples, sft_examples, tiny_generator, tiny_processor, tiny_retriever, training_args

LR = 0.5


class InOrder(IterableDataset):
    def __init__(self, items):
        self.items = items

    def __iter__(self):
        return iter(self.items)


def collator():
    return RetrievalWireCollator(RetrievalCollator(tiny_processor()))


def reference_losses(model, batches):
    """Late-interaction loss of each batch, gradients accumulated as the mean over batches."""
    loss_fn = LateInteractionLoss(temperature=0.02)
    losses = []
    for examples in batches:
        batch = RetrievalCollator(tiny_processor())(examples)
        q, d = model(queries=batch["queries"], docs=batch["docs"])
        loss = loss_fn(q.embeddings, q.mask, d.embeddings, d.mask)
        (loss / len(batches)).backward()
        losses.append(loss.item())
    return losses


def sgd_expected(model):
    with torch.no_grad():
        return {n: p - LR * p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("grad_cache_budget", [None, 1])  # 1: GradCache with one sample per chunk
@pytest.mark.parametrize("accumulation", [1, 2])
def test_trainer_step_equals_loss_and_step_on_same_batches(tmp_path, monkeypatch, accumulation, grad_cache_budget):
    import raggedvl.hf.trainer as hf_trainer

    chunks = []
    real_step = hf_trainer.grad_cache_step

    def counting_step(*a, **k):
        out = real_step(*a, **k)
        chunks.append(out.doc_chunks)
        return out

    monkeypatch.setattr(hf_trainer, "grad_cache_step", counting_step)
    examples = retrieval_examples(4)
    reference = tiny_retriever()
    per_batch = 4 // accumulation
    losses = reference_losses(reference, [examples[i:i + per_batch] for i in range(0, 4, per_batch)])
    expected = sgd_expected(reference)
    model = tiny_retriever()
    args = training_args(tmp_path, per_device_train_batch_size=per_batch, gradient_accumulation_steps=accumulation,
                         max_steps=1, learning_rate=LR)
    trainer = RaggedTrainer(model, args, processor=tiny_processor(), train_dataset=InOrder(examples), data_collator=collator(),
                            grad_cache_budget=grad_cache_budget)
    trainer.train()
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert logged == pytest.approx([sum(losses) / len(losses)], rel=1e-6)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), expected[n], rtol=0, atol=1e-10, msg=n)
    assert chunks == ([] if grad_cache_budget is None else [per_batch] * accumulation)  # one chunk per sample


def test_several_devices_wrap_in_ragged_data_parallel(tmp_path):
    """With n_gpu > 1 the Trainer's DataParallel is RaggedDataParallel, and the losses through it
    (retrieval: two scattered forwards; SFT: replica losses summed over the exact token count)
    equal the unwrapped model's. Without CUDA the wrapper runs the whole batch, so this checks
    the Trainer wiring; the scatter itself is tested in tests/parallel."""
    proc = tiny_processor()
    retr = RaggedTrainer(tiny_retriever(), training_args(tmp_path), processor=proc,
                         train_dataset=retrieval_examples(4), data_collator=collator())
    retr.args._n_gpu = 2
    wrapped = retr._wrap_model(retr.model)
    assert isinstance(wrapped, RaggedDataParallel)
    inputs = retr._prepare_inputs(collator()(retrieval_examples(4)))
    torch.testing.assert_close(retr.compute_loss(wrapped, inputs), retr.compute_loss(retr.model, inputs), rtol=0, atol=1e-12)

    gen = RaggedSFTTrainer(tiny_generator(), training_args(tmp_path), processor=proc, train_dataset=sft_examples(), data_collator=SFTCollator(proc))
    gen.args._n_gpu = 2
    batch = gen.decode_batch(SFTCollator(proc)(sft_examples()))
    exact = int(batch["labels"][:, 1:].ne(-100).sum())
    count = gen._get_num_items_in_batch([batch], torch.device("cpu"))
    assert count == exact  # the stock Trainer would hand each replica exact // n_gpu
    direct = gen.model(**batch.to_dict(), use_cache=False).loss
    through = gen.compute_loss(gen._wrap_model(gen.model), batch, num_items_in_batch=count)
    torch.testing.assert_close(through, direct, rtol=1e-12, atol=0)


def test_lora_retriever_trains_adapters_and_head_only(tmp_path):
    model = tiny_retriever(lora=LoraSettings(r=4, alpha=8, dropout=0.0))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    trainer = RaggedTrainer(model, training_args(tmp_path, max_steps=1, per_device_train_batch_size=4), processor=tiny_processor(),
                            train_dataset=retrieval_examples(4), data_collator=collator())
    trainer.train()
    changed = {n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])}
    assert changed <= trainable
    assert any(n.startswith("head.") for n in changed) and any("lora_B" in n for n in changed)


def test_argument_errors(tmp_path):
    proc = tiny_processor()
    args = training_args(tmp_path)
    with pytest.raises(TypeError, match="RaggedSFTTrainer"):
        RaggedTrainer(tiny_retriever(), args, processor=proc, task="sft")
    with pytest.raises(ValueError, match="learnable_scale"):
        RaggedTrainer(tiny_retriever(), args, processor=proc, loss=InfoNCELoss(learnable_scale=True, temperature=0.05))
    with pytest.raises(ValueError, match="must be a raggedvl"):
        RaggedTrainer(tiny_retriever(), args, processor=proc, loss=nn.MSELoss())
    with pytest.raises(ValueError, match="grad_cache_budget is for retrieval"):
        RaggedSFTTrainer(tiny_generator(), args, processor=proc, grad_cache_budget=64)
    with pytest.raises(ValueError, match="grad_cache_budget must be >= 1"):
        RaggedTrainer(tiny_retriever(), args, processor=proc, grad_cache_budget=0)
    with pytest.raises(ValueError, match="causal-LM loss"):
        RaggedSFTTrainer(tiny_generator(), args, processor=proc, loss=LateInteractionLoss())


def test_evaluate_reports_the_loss_of_the_eval_set(tmp_path):
    examples = retrieval_examples(4)
    model = tiny_retriever()
    trainer = RaggedTrainer(model, training_args(tmp_path, per_device_eval_batch_size=4), processor=tiny_processor(),
                            eval_dataset=examples, data_collator=collator())
    metrics = trainer.evaluate()
    batch = RetrievalCollator(tiny_processor())(examples)
    with torch.no_grad():
        q, d = model(queries=batch["queries"], docs=batch["docs"])
        expected = LateInteractionLoss(temperature=0.02)(q.embeddings, q.mask, d.embeddings, d.mask).item()
    assert metrics["eval_loss"] == pytest.approx(expected, rel=1e-6)


def test_skipped_examples_are_reported(tmp_path, caplog):
    examples = retrieval_examples(3)
    examples[1] = {**examples[1], "image": None, "image_error": "corrupt PNG"}
    wire_collate = RetrievalWireCollator(RetrievalCollator(tiny_processor(), on_bad_image="skip"))
    with caplog.at_level("WARNING"):
        out = wire_collate(examples)
    assert out["docs"]["ragged_num_tokens"].numel() == 2
    assert [s["id"] for s in wire_collate.skipped] == ["ex1"] and "skipped 1 example" in caplog.text


@pytest.mark.parametrize("given, expected", [(None, False), (True, True), (False, False)])
def test_ddp_does_not_search_for_unused_parameters_unless_asked(tmp_path, given, expected):
    """Every parameter takes part in every forward (the dummy vision pass), so DDP's per-step search
    for unused ones is pure cost: off unless the user set it."""
    from raggedvl.hf import RaggedTrainer
    from tests.hf.helpers import tiny_processor, tiny_retriever, training_args

    args = training_args(tmp_path, ddp_find_unused_parameters=given)
    trainer = RaggedTrainer(tiny_retriever(), args, processor=tiny_processor())
    assert trainer.args.ddp_find_unused_parameters is expected

"""RaggedTrainer masks in-batch false negatives as ``raggedvl train`` does: two questions about one
page never push each other's page away. The keys come from the collator, travel in the wire form
(and through accelerate's dispatch with their samples), and reach the loss; the loss's exactness
across processes is proven in tests/dist/test_losses_dist.py. float64 tiny retriever: the same
operations in the same order, so the trainer's loss equals the loss module's to 1e-12."""

from __future__ import annotations

import pytest
import torch

from raggedvl.data import RetrievalCollator
from raggedvl.hf import RaggedTrainer, RetrievalWireCollator
from raggedvl.parallel import RaggedDispatchSlicer
from tests.hf.helpers import retrieval_examples, tiny_processor, tiny_retriever, training_args


def _shared_page_examples():
    """Four examples; examples 0 and 2 ask different questions about the same page."""
    examples = retrieval_examples(4)
    examples[2] = {**examples[2], "image": examples[0]["image"].copy()}
    return examples


def test_the_wire_collator_carries_page_and_query_keys():
    wire = RetrievalWireCollator(RetrievalCollator(tiny_processor()))(_shared_page_examples())
    doc_keys, query_keys = wire["doc_keys"].tolist(), wire["query_keys"].tolist()
    assert doc_keys[0] == doc_keys[2] and len(set(doc_keys)) == 3  # equal exactly for the shared page
    assert len(set(query_keys)) == 4
    sliced = RaggedDispatchSlicer(token_ids=tiny_processor())(wire, slice(1, 3))  # accelerate's dispatch
    assert sliced["doc_keys"].tolist() == doc_keys[1:3] and sliced["query_keys"].tolist() == query_keys[1:3]


@pytest.mark.parametrize("mode", ["mask", "keep"])
def test_the_trainer_loss_masks_the_shared_page(tmp_path, mode):
    model = tiny_retriever()
    trainer = RaggedTrainer(model, training_args(tmp_path), processor=tiny_processor(), false_negatives=mode,
                            data_collator=RetrievalWireCollator(RetrievalCollator(tiny_processor())))
    wire = trainer.data_collator(_shared_page_examples())
    inputs = trainer._prepare_inputs(wire)
    with torch.no_grad():
        got = trainer.compute_loss(model, inputs)
        batch = trainer.decode_batch(wire)
        q, d = model(queries=batch["queries"], docs=batch["docs"])
        masked = trainer.retrieval_loss(q, d, doc_keys=batch["doc_keys"], query_keys=batch["query_keys"])
        kept = trainer.retrieval_loss(q, d)
    assert trainer.retrieval_loss.loss.false_negatives.item() == 0  # the last call, without keys
    expected = masked if mode == "mask" else kept
    assert abs(got.item() - expected.item()) < 1e-12
    assert abs(masked.item() - kept.item()) > 1e-6  # the shared page does change the loss


def test_a_bad_mode_is_refused(tmp_path):
    with pytest.raises(ValueError, match="false_negatives must be 'mask' or 'keep'"):
        RaggedTrainer(tiny_retriever(), training_args(tmp_path), processor=tiny_processor(), false_negatives="drop")

"""The HF Trainer (``raggedvl.hf.RaggedTrainer``) on 2 gloo processes, against one-process references.

One launch runs two jobs on each rank:

1. retrieval, IterableDataset -> accelerate ``dispatch_batches`` (case C03): 8 samples with
   different grids, 2 per process per step. Every process must receive whole samples (grid rows,
   patch rows, placeholder tokens and query tokens equal to that sample processed alone), the
   logged loss must equal the single-process late-interaction loss over the 4-sample global
   batch, and the weights after 2 SGD steps must equal the single-process weights (float64).
   The reference is the model + ``LateInteractionLoss`` applied directly to the same global
   batches, not ``raggedvl.app.loop.Trainer``.
2. SFT, map-style dataset -> DDP with per-process batches of different token counts: the
   logged loss must be the token mean over both processes' batches and the weights after one
   step must match the one-process step on the concatenated batch (checks the Trainer's
   ``num_items_in_batch`` / world-size scaling).
3. SFT, IterableDataset -> dispatch: samples with 2, 3, 0 and 0 images; process 1 gets only
   text (its vision tower is unused under DDP: no hang), process 0 both multi-image samples whole.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.dist.harness import run_distributed
from tests.hf.helpers import Stream, trainable

pytestmark = pytest.mark.dist

LR = 0.5
TOL = 1e-9
LOGGED_TOL = 1e-6  # the Trainer accumulates logged losses in float32


def sft_stream() -> list[dict]:
    from tests.hf.helpers import sft_examples

    two, text, three = sft_examples()
    return [two, three, text, {"images": [], "prompt": "name a plot", "answer": "a biplot of multivariate data"}]


def _worker(rank: int, world_size: int, out_dir: str):
    os.environ["LOCAL_WORLD_SIZE"] = str(world_size)
    from raggedvl.data import RetrievalCollator
    from raggedvl.hf import RaggedSFTTrainer, RaggedTrainer, RetrievalWireCollator, SFTCollator, pack
    from tests.hf.helpers import retrieval_examples, sft_examples, tiny_generator, tiny_processor, tiny_retriever, training_args

    def recorder(base):
        class Recorder(base):
            def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
                loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
                self.local_losses.append(loss.item())
                batch = self.decode_batch(inputs)
                if isinstance(self, RaggedTrainer):
                    self.seen.append({k: pack(batch[k].to("cpu")) for k in ("queries", "docs")})
                else:
                    self.seen.append(pack(batch.to("cpu")))
                return loss
        return Recorder

    proc = tiny_processor()
    out = {}
    model = tiny_retriever()
    trainer = recorder(RaggedTrainer)(model, training_args(f"{out_dir}/r{rank}", learning_rate=LR), processor=proc,
                       train_dataset=Stream(retrieval_examples(8)), data_collator=RetrievalWireCollator(RetrievalCollator(proc)))
    trainer.seen, trainer.local_losses = [], []
    trainer.train()
    out["retrieval"] = {
        "dispatcher": type(trainer.get_train_dataloader()).__name__,
        "seen": trainer.seen,
        "local_losses": trainer.local_losses,
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "params": trainable(model),
    }
    gen = tiny_generator()
    examples = sft_examples() + [{"images": [], "prompt": "name a plot", "answer": "a biplot of multivariate data"}]
    trainer = recorder(RaggedSFTTrainer)(gen, training_args(f"{out_dir}/s{rank}", learning_rate=LR, max_steps=1),
                                         processor=proc, train_dataset=examples, data_collator=SFTCollator(proc))
    trainer.seen, trainer.local_losses = [], []
    trainer.train()
    out["sft"] = {
        "seen": trainer.seen,
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "params": trainable(gen),
    }
    trainer = recorder(RaggedSFTTrainer)(tiny_generator(), training_args(f"{out_dir}/d{rank}", max_steps=1),
                                         processor=proc, train_dataset=Stream(sft_stream()), data_collator=SFTCollator(proc))
    trainer.seen, trainer.local_losses = [], []
    trainer.train()
    out["sft_dispatch"] = {"seen": trainer.seen, "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h]}
    path = f"{out_dir}/rank{rank}.pt"  # tensors through a file: the queue would share their memory
    torch.save(out, path)
    return path


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    paths = run_distributed(_worker, 2, str(tmp_path_factory.mktemp("hf")), timeout=240)
    return [torch.load(p, weights_only=False) for p in paths]


def _reference_retrieval(steps: int, per_step: int):
    from raggedvl.data import RetrievalCollator
    from raggedvl.losses import LateInteractionLoss
    from tests.hf.helpers import retrieval_examples, tiny_processor, tiny_retriever

    collate = RetrievalCollator(tiny_processor())
    examples = retrieval_examples(8)
    model = tiny_retriever()
    loss_fn = LateInteractionLoss(temperature=0.02)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for s in range(steps):
        batch = collate(examples[s * per_step:(s + 1) * per_step])
        q, d = model(queries=batch["queries"], docs=batch["docs"])
        loss = loss_fn(q.embeddings, q.mask, d.embeddings, d.mask)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, trainable(model)


def test_dispatch_gives_each_process_whole_samples(results):
    """C03 through the Trainer: process p at step s holds samples 4s+2p, 4s+2p+1, intact."""
    from raggedvl.data import RetrievalCollator
    from raggedvl.hf import unpack
    from raggedvl.batch import TokenIds
    from tests.hf.helpers import retrieval_examples, tiny_processor

    proc = tiny_processor()
    ids = TokenIds.from_any(proc)
    collate = RetrievalCollator(proc)
    alone = [collate([ex]) for ex in retrieval_examples(8)]
    for rank, res in enumerate(results):
        r = res["retrieval"]
        assert r["dispatcher"] == "DataLoaderDispatcher"
        assert len(r["seen"]) == 2
        for step, wire in enumerate(r["seen"]):
            docs = unpack(wire["docs"], token_ids=ids)
            queries = unpack(wire["queries"], token_ids=ids)
            assert docs.num_samples == queries.num_samples == 2
            assert docs.image_counts == [1, 1]
            rows = torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.long), docs.patch_counts()]), 0).tolist()
            for j in range(2):
                ref = alone[4 * step + 2 * rank + j]
                ref_docs, ref_q = ref["docs"], ref["queries"]
                assert torch.equal(docs["image_grid_thw"][j], ref_docs["image_grid_thw"][0])
                assert torch.equal(docs["pixel_values"][rows[j]:rows[j + 1]], ref_docs["pixel_values"])
                n_placeholders = int((docs["input_ids"][j] == ids.image).sum())
                assert n_placeholders == int(ref_docs["image_grid_thw"][0].prod()) // 4
                mine = docs["input_ids"][j][docs["attention_mask"][j].bool()]
                assert torch.equal(mine, ref_docs["input_ids"][0][ref_docs["attention_mask"][0].bool()])
                q_mine = queries["input_ids"][j][queries["attention_mask"][j].bool()]
                assert torch.equal(q_mine, ref_q["input_ids"][0][ref_q["attention_mask"][0].bool()])


def test_retrieval_loss_and_weights_match_single_process(results):
    ref_losses, ref_params = _reference_retrieval(steps=2, per_step=4)
    # L_r = (W/N) sum of local terms: the mean over processes is the global loss
    mean_share = [sum(r) / len(results) for r in zip(*(res["retrieval"]["local_losses"] for res in results))]
    assert mean_share == pytest.approx(ref_losses, rel=TOL)
    assert results[0]["retrieval"]["local_losses"] != pytest.approx(ref_losses, rel=1e-3)  # shares differ from L
    for res in results:
        r = res["retrieval"]
        assert r["losses"] == pytest.approx(ref_losses, rel=LOGGED_TOL)
        assert set(r["params"]) == set(ref_params)
        for name, value in ref_params.items():
            torch.testing.assert_close(r["params"][name], value, rtol=0, atol=TOL, msg=name)
    moved = any(not torch.equal(results[0]["retrieval"]["params"][n], p) for n, p in _initial_retriever().items())
    assert moved


def _initial_retriever():
    from tests.hf.helpers import tiny_retriever

    return trainable(tiny_retriever())


def test_sft_loss_is_global_token_mean(results):
    from raggedvl.batch import RaggedBatch
    from raggedvl.batch import TokenIds
    from raggedvl.hf import unpack
    from tests.hf.helpers import tiny_generator, tiny_processor

    proc = tiny_processor()
    ids = TokenIds.from_any(proc)
    parts = [unpack(res["sft"]["seen"][0], token_ids=ids, pad_token_id=proc.tokenizer.pad_token_id) for res in results]
    tokens = [int(p["labels"][:, 1:].ne(-100).sum()) for p in parts]
    assert tokens[0] != tokens[1], "the test needs unequal label-token counts per process"
    batch = RaggedBatch.concat(parts, pad_token_id=proc.tokenizer.pad_token_id)
    model = tiny_generator()
    loss = model(**batch.to_dict(), use_cache=False).loss
    torch.optim.SGD(model.parameters(), lr=LR).zero_grad()
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= LR * p.grad
    ref = trainable(model)
    for res in results:
        assert res["sft"]["losses"] == pytest.approx([loss.item()], rel=LOGGED_TOL)
        for name, value in ref.items():
            torch.testing.assert_close(res["sft"]["params"][name], value, rtol=0, atol=TOL, msg=name)


def test_sft_dispatch_keeps_multi_image_samples_whole_and_text_only_rank_runs(results):
    from raggedvl.batch import TokenIds
    from raggedvl.hf import SFTCollator, unpack
    from tests.hf.helpers import tiny_processor

    proc = tiny_processor()
    ids = TokenIds.from_any(proc)
    stream = sft_stream()
    alone = [unpack(SFTCollator(proc)([ex]), token_ids=ids) for ex in stream]
    for rank, res in enumerate(results):
        got = unpack(res["sft_dispatch"]["seen"][0], token_ids=ids)
        mine = alone[2 * rank:2 * rank + 2]
        assert got.image_counts == [len(ex["images"]) for ex in stream[2 * rank:2 * rank + 2]]
        if rank == 1:
            assert got.num_images == 0 and "pixel_values" not in got
        else:
            assert torch.equal(got["pixel_values"], torch.cat([a["pixel_values"] for a in mine]))
            assert torch.equal(got["image_grid_thw"], torch.cat([a["image_grid_thw"] for a in mine]))
        for j, a in enumerate(mine):
            valid = got["attention_mask"][j].bool()
            assert torch.equal(got["input_ids"][j][valid], a["input_ids"][0])
            assert torch.equal(got["labels"][j][valid], a["labels"][0])
    losses = [res["sft_dispatch"]["losses"] for res in results]
    assert losses[0] == losses[1] and len(losses[0]) == 1 and losses[0][0] > 0

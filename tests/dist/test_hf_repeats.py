"""Repeated samples on the HF Trainer path and in sharded evaluation, 2 gloo processes.

When the dataset size is not a multiple of processes x per-device batch, accelerate completes the
epoch's last batch with samples from the start of the epoch. They must not count: the loss and
every gradient are the single-process ones over the real samples only (DESIGN.md section 4 on
the real global batch), and evaluation never scores a repeat. One launch runs, on each process:

1. ``stream5``: 5 pairs as an ``IterableDataset`` (accelerate's dispatcher), per-device batch 2.
   Step 2 is pair 4 on process 0 and a repeat of pair 0 on process 1: one real pair, no
   negative, so the late-interaction loss is exactly 0 (the repeat, counted, made it positive).
2. ``map5``: the same 5 pairs map-style, sequential order: step 2 is ``[4, 0 | 1, 2]``, three
   repeats; the loss is sample 4's alone (0).
3. ``map7_ga``: 7 pairs map-style with 2 accumulation steps: one optimizer step over the
   micro-batches ``[0, 1 | 2, 3]`` and ``[4, 5 | 6, 0]``; logged loss and weights equal the
   single-process mean of the two real micro-batch losses; ``map7_gc``: the same through
   GradCache (``grad_cache_budget``).
4. ``sft3``: SFT, 3 examples map-style: ``[0, 1 | 2, 0]``; the loss is the token mean over
   examples 0, 1, 2 and the weights equal one step on them (the repeat of 0 is not counted).
5. ``eval5``: ``RaggedTrainer.evaluate`` on the 5 pairs: the evaluation loss is the mean over the
   5 real queries of their terms, each in its own step's real global batch; ``sft_eval3``: SFT
   evaluation of ``[0, 1 | 2, 0]``, the token mean over examples 0, 1, 2.
6. ``encode5``: ``evaluate_benchmark`` (sharded encoding, batch 2) on the 5 pairs: metrics equal
   one process's.
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


def _worker(rank: int, world_size: int, out_dir: str):
    os.environ["LOCAL_WORLD_SIZE"] = str(world_size)
    from raggedvl.data import RetrievalCollator
    from raggedvl.hf import RaggedSFTTrainer, RaggedTrainer, RetrievalWireCollator, SFTCollator, pack
    from raggedvl import RetrievalBenchmark, evaluate_benchmark
    from tests.hf.helpers import retrieval_examples, retrieval_pairs, sft_examples, tiny_generator, tiny_processor, tiny_retriever, training_args

    def recorder(base):
        class Recorder(base):
            def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
                batch = self.decode_batch(inputs)
                if isinstance(self, RaggedTrainer):
                    self.seen.append({"queries": pack(batch["queries"].to("cpu")), "valid": batch["valid"].tolist()})
                else:
                    self.seen.append({"batch": pack(batch.to("cpu"))})
                return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        return Recorder

    proc = tiny_processor()
    collator = RetrievalWireCollator(RetrievalCollator(proc))

    def run(name, dataset, task="retrieval", model=None, grad_cache_budget=None, **overrides):
        model = model if model is not None else tiny_retriever()
        args = training_args(f"{out_dir}/{name}{rank}", learning_rate=LR, train_sampling_strategy="sequential", **overrides)
        if task == "retrieval":
            trainer = recorder(RaggedTrainer)(model, args, processor=proc, train_dataset=dataset,
                                              grad_cache_budget=grad_cache_budget, data_collator=collator)
        else:
            trainer = recorder(RaggedSFTTrainer)(model, args, processor=proc, train_dataset=dataset,
                                                 data_collator=SFTCollator(proc))
        trainer.seen = []
        trainer.train()
        return {"seen": trainer.seen, "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
                "params": trainable(model)}

    out = {
        "stream5": run("s5", Stream(retrieval_examples(5)), max_steps=2),
        "map5": run("m5", retrieval_examples(5), max_steps=-1, num_train_epochs=1),
        "map7_ga": run("m7", retrieval_examples(7), max_steps=-1, num_train_epochs=1, gradient_accumulation_steps=2),
        "map7_gc": run("g7", retrieval_examples(7), max_steps=-1, num_train_epochs=1, gradient_accumulation_steps=2,
                       grad_cache_budget=64),
        "sft3": run("t3", sft_examples(), task="sft", model=tiny_generator(), max_steps=-1, num_train_epochs=1),
    }
    evaluator = RaggedTrainer(tiny_retriever(), training_args(f"{out_dir}/e{rank}", per_device_eval_batch_size=2),
                              processor=proc, data_collator=collator)
    out["eval5"] = evaluator.evaluate(retrieval_examples(5))["eval_loss"]
    sft_evaluator = RaggedSFTTrainer(tiny_generator(), training_args(f"{out_dir}/f{rank}", per_device_eval_batch_size=2),
                                     processor=proc, data_collator=SFTCollator(proc))
    out["sft_eval3"] = sft_evaluator.evaluate(sft_examples())["eval_loss"]
    out["encode5"] = evaluate_benchmark(tiny_retriever(), RetrievalCollator(proc), RetrievalBenchmark.from_pairs(retrieval_pairs(5)),
                                        batch_size=2, device=torch.device("cpu"))
    path = f"{out_dir}/rank{rank}.pt"  # tensors through a file: the queue would share their memory
    torch.save(out, path)
    return path


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    paths = run_distributed(_worker, 2, str(tmp_path_factory.mktemp("hf-repeats")), timeout=400)
    return [torch.load(p, weights_only=False) for p in paths]


def _sample_ids(wire_queries) -> list[int]:
    """Which retrieval examples a recorded batch holds (each example's query tokens are unique)."""
    from raggedvl.batch import TokenIds
    from raggedvl.hf import unpack
    from tests.hf.helpers import retrieval_examples, tiny_processor

    proc = tiny_processor()
    texts = [ex["query"] for ex in retrieval_examples(8)]
    batch = unpack(wire_queries, token_ids=TokenIds.from_any(proc), pad_token_id=proc.tokenizer.pad_token_id)
    decoded = proc.tokenizer.batch_decode([ids[m.bool()] for ids, m in zip(batch["input_ids"], batch["attention_mask"])])
    return [next(i for i, t in enumerate(texts) if t in d) for d in decoded]


def _real_loss(indices, model):
    from raggedvl.data import RetrievalCollator
    from raggedvl.losses import LateInteractionLoss
    from tests.hf.helpers import retrieval_examples, tiny_processor

    examples = retrieval_examples(8)
    batch = RetrievalCollator(tiny_processor())([examples[i] for i in indices])
    q, d = model(queries=batch["queries"], docs=batch["docs"])
    return LateInteractionLoss(temperature=0.02)(q.embeddings, q.mask, d.embeddings, d.mask)


def _sgd(model, loss):
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    opt.zero_grad()
    loss.backward()
    opt.step()


def _check_params(got, model):
    want = trainable(model)
    assert set(got) == set(want)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=TOL, msg=name)


@pytest.mark.parametrize("case", ["stream5", "map5"])
def test_last_step_with_one_real_pair_has_loss_zero(results, case):
    from tests.hf.helpers import tiny_retriever

    model = tiny_retriever()
    first = _real_loss([0, 1, 2, 3], model)
    _sgd(model, first)
    last = _real_loss([4], model)
    assert last.item() == 0.0  # one real pair, no negative
    for rank, res in enumerate(results):
        r = res[case]
        steps = [(_sample_ids(s["queries"]), s["valid"]) for s in r["seen"]]
        want = {"stream5": [([0, 1], [True, True]), ([2, 3], [True, True])][rank:rank + 1] + [([4], [True]), ([0], [False])][rank:rank + 1],
                "map5": [([0, 1], [True, True]), ([2, 3], [True, True])][rank:rank + 1]
                + [([4, 0], [True, False]), ([1, 2], [False, False])][rank:rank + 1]}[case]
        assert steps == want
        assert r["losses"] == pytest.approx([first.item(), 0.0], rel=LOGGED_TOL, abs=1e-12)
        _check_params(r["params"], model)


@pytest.mark.parametrize("case", ["map7_ga", "map7_gc"])
def test_gradient_accumulation_with_repeats_equals_mean_of_real_micro_batch_losses(results, case):
    """Plain steps and GradCache steps (``grad_cache_budget``) alike."""
    from tests.hf.helpers import tiny_retriever

    model = tiny_retriever()
    objective = 0.5 * (_real_loss([0, 1, 2, 3], model) + _real_loss([4, 5, 6], model))
    _sgd(model, objective)
    for rank, res in enumerate(results):
        r = res[case]
        if case == "map7_ga":  # GradCache steps do not go through compute_loss: nothing recorded
            steps = [(_sample_ids(s["queries"]), s["valid"]) for s in r["seen"]]
            assert steps == [[([0, 1], [True, True]), ([4, 5], [True, True])],
                             [([2, 3], [True, True]), ([6, 0], [True, False])]][rank]
        assert r["losses"] == pytest.approx([objective.item()], rel=LOGGED_TOL)
        _check_params(r["params"], model)


def test_sft_repeat_is_not_counted(results):
    from raggedvl.batch import TokenIds
    from raggedvl.hf import SFTCollator, unpack
    from tests.hf.helpers import sft_examples, tiny_generator, tiny_processor

    proc = tiny_processor()
    ids = TokenIds.from_any(proc)
    batch = unpack(SFTCollator(proc)(sft_examples()), token_ids=ids, pad_token_id=proc.tokenizer.pad_token_id)
    model = tiny_generator()
    loss = model(**batch.to_dict(), use_cache=False).loss  # token mean over examples 0, 1, 2
    _sgd(model, loss)
    for rank, res in enumerate(results):
        r = res["sft3"]
        got = unpack(r["seen"][0]["batch"], token_ids=ids, pad_token_id=proc.tokenizer.pad_token_id)
        real_tokens = int(got["labels"][:, 1:].ne(-100).sum())
        assert got.num_samples == 2
        if rank == 1:  # [2, 0]: the repeat of example 0 has no label left
            assert int(got["labels"][1].ne(-100).sum()) == 0 and real_tokens > 0
        assert r["losses"] == pytest.approx([loss.item()], rel=LOGGED_TOL)
        _check_params(r["params"], model)


def test_evaluation_loss_counts_each_real_query_once(results):
    from raggedvl.data import RetrievalCollator
    from raggedvl.losses import LateInteractionLoss
    from tests.hf.helpers import retrieval_examples, tiny_processor, tiny_retriever

    model = tiny_retriever()
    collate = RetrievalCollator(tiny_processor())
    examples = retrieval_examples(5)
    with torch.no_grad():
        full = 4 * _real_loss([0, 1, 2, 3], model).item()  # 4 queries; the last step's one query scores 0
        batch = collate(examples[4:])
        q, d = model(queries=batch["queries"], docs=batch["docs"])
        full += LateInteractionLoss(temperature=0.02)(q.embeddings, q.mask, d.embeddings, d.mask).item()
    for res in results:
        assert res["eval5"] == pytest.approx(full / 5, rel=LOGGED_TOL)


def test_sft_evaluation_loss_ignores_the_repeat(results):
    from raggedvl.batch import TokenIds
    from raggedvl.hf import SFTCollator, unpack
    from tests.hf.helpers import sft_examples, tiny_generator, tiny_processor

    proc = tiny_processor()
    batch = unpack(SFTCollator(proc)(sft_examples()), token_ids=TokenIds.from_any(proc), pad_token_id=proc.tokenizer.pad_token_id)
    with torch.no_grad():
        expected = tiny_generator()(**batch.to_dict(), use_cache=False).loss.item()
    for res in results:
        assert res["sft_eval3"] == pytest.approx(expected, rel=LOGGED_TOL)


def test_sharded_encoding_scores_every_pair_once(results):
    from raggedvl.data import RetrievalCollator
    from raggedvl import RetrievalBenchmark, evaluate_benchmark
    from tests.hf.helpers import retrieval_pairs, tiny_processor, tiny_retriever

    ref = evaluate_benchmark(tiny_retriever(), RetrievalCollator(tiny_processor()),
                             RetrievalBenchmark.from_pairs(retrieval_pairs(5)), batch_size=2, device=torch.device("cpu"))
    assert ref["queries"] == 5 and ref["documents"] == 5
    for res in results:
        assert res["encode5"] == pytest.approx(ref, rel=1e-9)

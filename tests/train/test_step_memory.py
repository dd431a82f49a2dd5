"""What a training step leaves alive: it frees its gradients right after the optimizer step, so
no parameter-sized set of last step's gradients sits beside the next forward's activations (the
peak is at the forward/backward turn), and each step applies exactly its own gradient (step 2 of
a run equals a hand-written step 2 on an identical model); the loop drops a batch before the
next one is collated, so two batches' pixel rows are never alive together (BENCHMARKS.md,
"vs colpali-engine": the 1-process peak)."""

from __future__ import annotations

import weakref

import pytest
import torch

from raggedvl.parallel import init_distributed
from raggedvl.app.config import TrainConfig
from raggedvl.app.loop import Trainer

pytestmark = pytest.mark.slow  # tiny model, two steps on two trainers


def _trainer(tmp_path, cache, name, **extra):
    cfg = TrainConfig(**{"max_steps": 4, **extra}, global_batch_size=4, max_train_samples=16, max_eval_samples=8, eval_before=False,
                      eval_after=False, lr=1e-3, output_dir=str(tmp_path / name), data_cache=str(cache))
    return Trainer(cfg, init_distributed())


def _batches(trainer, n):
    sampler = iter(trainer.c.sampler)
    return [trainer.c.collate([trainer.c.train_set[i] for i in next(sampler)]) for _ in range(n)]


def _grads(trainer):
    return [p.grad for p in trainer.model.parameters() if p.requires_grad]


@pytest.mark.parametrize("grad_cache", [False, True])
def test_gradients_are_freed_after_each_step_and_never_carried_over(tmp_path, small_data_cache, grad_cache):
    run = _trainer(tmp_path, small_data_cache, "run", grad_cache=grad_cache)
    ref = _trainer(tmp_path, small_data_cache, "ref", grad_cache=grad_cache)
    assert all(torch.equal(a, b) for a, b in zip(run.model.parameters(), ref.model.parameters()))
    first, second = _batches(run, 2)
    assert all(g is None for g in _grads(run))
    run.train_step(first)
    ref.train_step(first)
    assert all(g is None for g in _grads(run)) and all(g is None for g in _grads(ref))

    run.train_step(second)
    assert all(g is None for g in _grads(run))
    # step 2 by hand on the reference: only this batch's gradient, clipped, one AdamW step
    ref.optimizer.zero_grad(set_to_none=True)  # a no-op here; the reference must not depend on train_step's
    q, d = ref.model(queries=second["queries"], docs=second["docs"])
    ref.c.loss(q, d).backward()
    torch.nn.utils.clip_grad_norm_(ref.model.parameters(), ref.cfg.max_grad_norm or float("inf"))
    ref.optimizer.step()
    for (name, a), b in zip(run.model.named_parameters(), ref.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


def test_a_batch_is_freed_before_the_next_one_is_collated(tmp_path, small_data_cache):
    # collating on the training thread (with a worker process, batches are pickled copies)
    trainer = _trainer(tmp_path, small_data_cache, "run", max_steps=3, data_workers=0)
    collate, earlier, alive = trainer.c.collate, [], []

    def watched(rows):
        alive.append([ref() is not None for ref in earlier])  # what is still referenced at this call
        batch = collate(rows)
        earlier.append(weakref.ref(batch["docs"]))
        return batch

    trainer.c.collate = watched
    trainer.run()
    assert len(earlier) >= 3 and trainer.step == 3
    assert alive[:3] == [[], [False], [False, False]], alive

"""The training step with hard negatives on 2 real gloo processes against the single-process
reference (float64 tiny retriever, STYLE.md item 10 tier c).

Rank 0 holds 3 pairs and rank 1 holds 1 (unequal n_r), each pair with k = 2 hard negatives. A
rank encodes its documents and their negatives in ONE forward call (as ``Trainer.train_step``
does) and calls :func:`raggedvl.losses.loss_with_negatives`, whose loss gathers the positives
and the negatives of both ranks. Reference: one process, the loss's own hard-negative path
``loss(q, d, n)`` on three separate encodes of the whole global batch (``gather_across_ranks=False``).
Checked for the late-interaction and the bi-encoder losses, with DDP and with GradCache:
the global loss (mean of the L_r) and every parameter gradient.
"""

from __future__ import annotations

import copy

import pytest
import torch

from raggedvl.batch import RaggedBatch
from raggedvl.losses import loss_with_negatives
from tests.dist.harness import run_distributed
from tests.gradcache.test_grad_cache import grads, make_loss_fn, max_diff, pair_batches, tiny_model

ROWS = {0: [0, 1, 2], 1: [3]}
K = 2


def _negative_rows(rows: list[int]) -> list[int]:
    """k documents per pair, query-major, from other rows of the table."""
    return [(r + 4 + j) % 8 for r in rows for j in range(K)]


def _batches(rows: list[int]):
    queries, docs = pair_batches(rows)
    _, negatives = pair_batches(_negative_rows(rows))
    return queries, docs, negatives


def _reference(model, head: str) -> tuple[float, dict[str, torch.Tensor]]:
    queries, docs, negatives = _batches(ROWS[0] + ROWS[1])
    loss_fn = make_loss_fn(head, gather_across_ranks=False)
    model.zero_grad(set_to_none=True)
    q, d, n = model(**queries), model(**docs), model(**negatives)
    loss = loss_fn(q, d, n)
    loss.backward()
    return float(loss.detach()), grads(model)


def _global_loss(loss: torch.Tensor) -> float:
    import torch.distributed as dist

    t = loss.detach().clone()
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


def _checks(rank: int, world_size: int) -> dict:
    from raggedvl.gradcache import grad_cache_step
    from raggedvl.parallel.wrap import wrap_model

    out: dict = {}
    for head in ("late_interaction", "bi_encoder"):
        model = tiny_model(head)
        ref_loss, ref = _reference(copy.deepcopy(model), head)
        ref = {f"module.{k}": v for k, v in ref.items()}
        ddp = wrap_model(model, strategy="ddp")
        queries, docs, negatives = _batches(ROWS[rank])
        both = RaggedBatch.concat([docs, negatives])
        loss = make_loss_fn(head)

        def loss_fn(q, d, n_docs=docs.num_samples, loss=loss):
            return loss_with_negatives(loss, q, d, n_docs)

        ddp.zero_grad(set_to_none=True)
        q, d = ddp(queries=queries, docs=both)  # one forward call, as the training step makes
        step_loss = loss_fn(q, d)
        step_loss.backward()
        out[f"{head}/ddp/loss"] = abs(_global_loss(step_loss) - ref_loss)
        out[f"{head}/ddp/grad"] = max_diff(ref, grads(ddp))
        ddp.zero_grad(set_to_none=True)
        cached = grad_cache_step(ddp, queries, both, loss_fn, budget=40)
        out[f"{head}/grad_cache/loss"] = abs(_global_loss(cached.loss) - ref_loss)
        out[f"{head}/grad_cache/grad"] = max_diff(ref, grads(ddp))
        out[f"{head}/ref_loss"] = ref_loss
        with torch.no_grad():  # the negatives matter: the loss without them differs
            plain = make_loss_fn(head, gather_across_ranks=False)
            all_q, all_d, _ = _batches(ROWS[0] + ROWS[1])
            out[f"{head}/without_negatives"] = float(plain(model(**all_q), model(**all_d)))
    return out


@pytest.mark.dist
def test_training_step_with_hard_negatives_matches_single_process_on_two_ranks():
    results = run_distributed(_checks, 2, timeout=120)
    for r, result in enumerate(results):
        for key, value in result.items():
            if key.endswith(("/loss", "/grad")):
                assert value < 1e-10, (r, key, value)
        for head in ("late_interaction", "bi_encoder"):
            assert abs(result[f"{head}/ref_loss"] - result[f"{head}/without_negatives"]) > 1e-3, (r, head)

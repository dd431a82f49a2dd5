"""GradCache on 2 real gloo processes against the single-process reference (float64).

Rank 0 holds 4 pairs and rank 1 holds 2 (unequal n_r); with budget 25 rank 0 cuts 2 query
chunks and 4 document chunks, rank 1 cuts 1 and 2 (unequal chunk counts). One launch checks:
DDP late interaction (two consecutive steps: the second one runs DDP's bucket rebuild),
the non-cached DDP step on the same data, DDP bi-encoder with LoRA and gradient checkpointing,
DDP with dropout 0.1 (reference: the same chunks encoded with graphs and the same per-rank
seeds, one backward, gradients averaged by hand), and FSDP2 with padding chunks.
"""

from __future__ import annotations

import copy

import pytest
import torch

from raggedvl.gradcache import grad_cache_step
from tests.dist.harness import run_distributed
from tests.gradcache.test_grad_cache import (
    cached_step,
    chunked_graph_step,
    make_loss_fn,
    max_diff,
    pair_batches,
    plain_step,
    tiny_model,
)

ROWS = {0: [0, 1, 2, 3], 1: [4, 5]}
BUDGET = 25


def _reference(model, head: str) -> tuple[float, dict[str, torch.Tensor]]:
    """Single-process loss and gradients of the whole global batch (rows of every rank)."""
    queries, docs = pair_batches(ROWS[0] + ROWS[1])
    return plain_step(model, queries, docs, make_loss_fn(head, gather_across_ranks=False))


def _global_loss(loss: torch.Tensor) -> float:
    import torch.distributed as dist

    t = loss.detach().clone()
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


def _ddp_checks(rank: int, world_size: int, head: str, model, out: dict, tag: str) -> None:
    from raggedvl.parallel.wrap import wrap_model

    ref_loss, ref = _reference(copy.deepcopy(model), head)
    ddp = wrap_model(model, strategy="ddp")
    queries, docs = pair_batches(ROWS[rank])
    loss_fn = make_loss_fn(head)
    for step_no in (1, 2):  # the second step runs after DDP rebuilt its buckets
        step, got = cached_step(ddp, queries, docs, loss_fn, BUDGET)
        out[f"{tag}/step{step_no}/grad"] = max_diff({f"module.{k}": v for k, v in ref.items()}, got)
        out[f"{tag}/step{step_no}/loss"] = abs(_global_loss(step.loss) - ref_loss)
    out[f"{tag}/chunks"] = (step.query_chunks, step.doc_chunks)
    if head == "late_interaction":
        loss, got = plain_step(ddp, queries, docs, loss_fn)
        out[f"{tag}/non_cached/grad"] = max_diff({f"module.{k}": v for k, v in ref.items()}, got)


def _dropout_checks(rank: int, world_size: int, out: dict) -> None:
    import torch.distributed as dist

    from raggedvl.parallel.wrap import wrap_model

    model = tiny_model(lora_dropout=0.1, attention_dropout=0.1)
    plain = copy.deepcopy(model)
    queries, docs = pair_batches(ROWS[rank])
    loss_fn = make_loss_fn("late_interaction")
    torch.manual_seed(100 + rank)
    _, ref = chunked_graph_step(plain, queries, docs, loss_fn, BUDGET)
    for g in ref.values():
        dist.all_reduce(g)
        g /= world_size
    ddp = wrap_model(model, strategy="ddp")
    torch.manual_seed(100 + rank)
    _, got = cached_step(ddp, queries, docs, loss_fn, BUDGET)
    out["dropout/grad"] = max_diff({f"module.{k}": v for k, v in ref.items()}, got)
    torch.manual_seed(200 + rank)  # other masks: the comparison above depends on the replay
    _, other = chunked_graph_step(plain, queries, docs, loss_fn, BUDGET)
    for g in other.values():
        dist.all_reduce(g)
        g /= world_size
    out["dropout/other_masks"] = max_diff(ref, other)


def _fsdp2_checks(rank: int, world_size: int, out: dict) -> None:
    from raggedvl.parallel.wrap import wrap_model

    model = tiny_model()
    ref_loss, ref = _reference(copy.deepcopy(model), "late_interaction")
    sharded = wrap_model(model, strategy="fsdp2")
    queries, docs = pair_batches(ROWS[rank])
    sharded.zero_grad(set_to_none=True)
    step = grad_cache_step(sharded, queries, docs, make_loss_fn("late_interaction"), budget=BUDGET)
    full = {n: p.grad.full_tensor() for n, p in sharded.named_parameters() if p.requires_grad}
    out["fsdp2/grad"] = max_diff(ref, full)
    out["fsdp2/loss"] = abs(_global_loss(step.loss) - ref_loss)
    out["fsdp2/chunks"] = (step.query_chunks, step.doc_chunks)
    out["fsdp2/forwards"] = (step.query_forwards, step.doc_forwards)


def _all_checks(rank: int, world_size: int) -> dict:
    out: dict = {}
    _ddp_checks(rank, world_size, "late_interaction", tiny_model(), out, "ddp_li")
    _ddp_checks(rank, world_size, "bi_encoder", tiny_model("bi_encoder", lora_dropout=0.0, checkpointing=True),
                out, "ddp_bi_lora_ckpt")
    _dropout_checks(rank, world_size, out)
    _fsdp2_checks(rank, world_size, out)
    return out


@pytest.mark.dist
def test_grad_cache_matches_single_process_on_two_ranks():
    results = run_distributed(_all_checks, 2, timeout=120)
    r0, r1 = results
    assert r0["ddp_li/chunks"] == (2, 4) and r1["ddp_li/chunks"] == (1, 2)  # unequal chunk counts
    assert r0["fsdp2/chunks"] == (2, 4) and r1["fsdp2/chunks"] == (1, 2)
    assert r0["fsdp2/forwards"] == r1["fsdp2/forwards"] == (2, 4)  # rank 1 ran padding chunks
    for res in results:
        for key, value in res.items():
            if key.endswith(("/grad", "/loss")):
                assert value < 1e-10, (key, value)
        assert res["dropout/other_masks"] > 1e-4

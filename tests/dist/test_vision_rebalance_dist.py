"""Encoder rebalancing on real gloo processes: exact gradients.

Rank 0 holds one large image among small ones (its vision-tower load is far above the mean);
the other ranks hold small images, or text-only documents (W = 3). With
``Retriever.set_vision_rebalancer(VisionRebalancer())`` the plan moves rank 0's small images to
the other ranks, which encode them and send the features back. For each case the loss and
every trainable parameter's gradient (float64, after DDP's average or FSDP2's reduce-scatter,
shards gathered whole) must equal (a) the same ranks without rebalancing and (b) the
single-process loss and gradients on the concatenated global batch, computed in the parent.
One launch per world size runs every case of that size. Tolerances: see ``REF_TOL``.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from tests.dist.harness import run_distributed

pytestmark = pytest.mark.dist

TOL = 1e-10
# transformers' Qwen-VL vision attention casts q and k to float32 (apply_rotary_pos_emb_vision), so
# in a float64 model a tower call over other images rounds differently (~1e-7 relative, carried into
# the decoder's gradients): the distributed runs, rebalanced or not, match one process to REF_TOL
# (relative to each parameter's largest gradient) and each other to TOL
REF_TOL = 1e-5
TEMPERATURE = 0.05
BIG = {"images": [(1, 16, 16)], "text": 2}
SMALL = {"images": [(1, 4, 4)], "text": 3}
TWO_SMALL = {"images": [(1, 2, 4), (1, 4, 2)], "text": 2}
TEXT = {"text": 6}


@dataclass(frozen=True)
class Case:
    family: str
    strategy: str  # "ddp" | "fsdp2"
    checkpointing: bool
    ranks: tuple[tuple[dict, ...], ...]  # documents of each rank


CASES = {
    2: {
        "qwen2_vl-ddp": Case("qwen2_vl", "ddp", False, ((BIG, SMALL, TWO_SMALL), (SMALL,))),
        "qwen2_5_vl-fsdp2-ckpt": Case("qwen2_5_vl", "fsdp2", True, ((SMALL, BIG, TWO_SMALL), (TWO_SMALL,))),
        "qwen3_vl-ddp-deepstack": Case("qwen3_vl", "ddp", False, ((BIG, TWO_SMALL, SMALL), (TEXT, SMALL))),
    },
    3: {
        "qwen2_vl-ddp-text_only_rank": Case("qwen2_vl", "ddp", False, ((BIG, TWO_SMALL, SMALL), (TEXT,), (SMALL, TEXT))),
    },
}


def _global_batches(case: Case):
    from raggedvl.batch import RaggedBatch
    from tests.batch.synth import SMALL_IDS, make_features

    samples = [s for rank in case.ranks for s in rank]
    docs = RaggedBatch.from_features(make_features(samples, layout=case.family, seed=3), case.family, token_ids=SMALL_IDS)
    texts = [{"text": 2 + i % 3} for i in range(len(samples))]
    queries = RaggedBatch.from_features(make_features(texts, layout=case.family, seed=4), case.family, token_ids=SMALL_IDS)
    return queries, docs, [len(r) for r in case.ranks]


def _build(case: Case):
    from raggedvl.models import Retriever, RetrieverConfig
    from tests.batch.tiny_models import tiny_model

    model = Retriever(tiny_model(case.family), RetrieverConfig(dim=16))
    model.set_gradient_checkpointing(case.checkpointing)
    torch.manual_seed(1)
    return model.double().train()


def _loss(model, queries, docs, gather: bool):
    from raggedvl.losses import make_retrieval_loss

    return make_retrieval_loss("late_interaction", temperature=TEMPERATURE, gather_across_ranks=gather)(
        *model(queries=queries, docs=docs))


def _step(case: Case, rank: int, world_size: int, rebalance: bool) -> dict:
    import torch.distributed as dist

    from raggedvl.parallel import VisionRebalancer
    from raggedvl.parallel.wrap import unwrap_model, wrap_model

    queries, docs, sizes = _global_batches(case)
    model = _build(case)
    rebalancer = VisionRebalancer() if rebalance else None
    model.set_vision_rebalancer(rebalancer)
    tower_calls: list[int] = []
    model.base_model.visual.register_forward_pre_hook(lambda m, args: tower_calls.append(int(args[0].shape[0])))
    wrapped = wrap_model(model, strategy=case.strategy)
    loss = _loss(wrapped, queries.split(sizes)[rank], docs.split(sizes)[rank], gather=True)
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    grads = {}
    for name, p in unwrap_model(wrapped).named_parameters():
        g = p.grad
        if g is not None and hasattr(g, "full_tensor"):
            g = g.full_tensor()
        grads[name] = None if g is None else g.detach().clone()
    plan = rebalancer.last_plan if rebalancer else None
    return {"loss": float(total) / world_size, "grads": grads, "tower_rows": tower_calls,
            "plan": None if plan is None else (plan.moved, plan.max_over_mean_before, plan.max_over_mean_after)}


def _worker(rank: int, world_size: int, out_dir: str) -> str:
    out = {name: {"on": _step(case, rank, world_size, True), "off": _step(case, rank, world_size, False)}
           for name, case in CASES[world_size].items()}
    path = f"{out_dir}/rank{rank}.pt"
    torch.save(out, path)  # tensors through the result queue would need the exited worker's file descriptors
    return path


@pytest.fixture(scope="module", params=[2, 3], ids=["W2", "W3"])
def launched(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"rebalance{request.param}")
    paths = run_distributed(_worker, request.param, str(out), timeout=420)
    return request.param, [torch.load(p, weights_only=False) for p in paths]


def _reference(case: Case) -> tuple[float, dict[str, torch.Tensor]]:
    queries, docs, _ = _global_batches(case)
    model = _build(case)
    loss = _loss(model, queries, docs, gather=False)
    loss.backward()
    return float(loss.detach()), {n: p.grad for n, p in model.named_parameters()}


def test_rebalanced_gradients_equal_no_rebalancing_and_one_process(launched):
    """Loss and every gradient: rebalanced == not rebalanced (TOL), == one process (REF_TOL, relative)."""
    world, results = launched
    for name, case in CASES[world].items():
        ref_loss, ref = _reference(case)
        worst = worst_ref = 0.0
        for rank, r in enumerate(results):
            on, off = r[name]["on"], r[name]["off"]
            moved, before, after = on["plan"]
            assert moved > 0 and after < before, (name, on["plan"])  # the plan did move images
            assert off["plan"] is None
            assert on["loss"] == pytest.approx(off["loss"], abs=TOL) and on["loss"] == pytest.approx(ref_loss, rel=REF_TOL)
            assert set(on["grads"]) == set(off["grads"]) == set(ref)
            for n, want in ref.items():
                assert on["grads"][n] is not None and off["grads"][n] is not None, (name, n)
                torch.testing.assert_close(on["grads"][n], off["grads"][n], rtol=0, atol=TOL,
                                           msg=f"{name} rank {rank}: {n}, rebalanced vs not")
                scale = max(1.0, float(want.abs().max()))
                torch.testing.assert_close(on["grads"][n], want, rtol=REF_TOL, atol=REF_TOL * scale, msg=f"{name} rank {rank}: {n}")
                worst = max(worst, float((on["grads"][n] - off["grads"][n]).abs().max()))
                worst_ref = max(worst_ref, float((on["grads"][n] - want).abs().max()) / scale)
        assert any(float(g.abs().max()) > 0 for n, g in ref.items() if "visual" in n)
        print(f"W={world} {name}: moved {results[0][name]['on']['plan'][0]} images, tower max/mean "
              f"{results[0][name]['on']['plan'][1]:.2f} -> {results[0][name]['on']['plan'][2]:.2f}, "
              f"max |grad - not rebalanced| {worst:.2e}, max |grad - single process| / max |grad| {worst_ref:.2e}")


def test_every_rank_runs_the_tower_once_per_document_encode(launched):
    """One tower call per rank for the documents (real or dummy), as FSDP2 and DDP need; the
    rank with the large image encodes fewer patch rows with rebalancing than without."""
    world, results = launched
    for name in CASES[world]:
        for r in results:
            assert len(r[name]["on"]["tower_rows"]) == len(r[name]["off"]["tower_rows"]) == 2, r[name]  # queries: dummy
        rows_on = [r[name]["on"]["tower_rows"][1] for r in results]
        rows_off = [r[name]["off"]["tower_rows"][1] for r in results]
        big = max(range(world), key=lambda k: rows_off[k])
        assert rows_on[big] < rows_off[big] and max(rows_on) < max(rows_off), (rows_on, rows_off)

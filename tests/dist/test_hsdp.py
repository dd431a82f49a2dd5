"""HSDP (``wrap_model(strategy="hsdp", shard_degree=2)``) on 4 gloo processes against one process.

The mesh is 2 x 2: ranks {0, 1} and {2, 3} each hold one sharded copy of the float64 tiny
retriever, ranks {0, 2} and {1, 3} hold the same shard. Every rank encodes its own rows of one
global batch (unequal counts: 3, 2, 1, 2 pairs) through the exact cross-rank late-interaction
loss, once with a plain backward and once through GradCache; the full gradients (gathered from
the shards) and the gradient norm that clipping reads must equal one process running the whole
global batch. Error model: float64 throughout and both sides start from the same weights, so
the only differences are the order of the reductions (reduce-scatter within a group, all-reduce
across groups, vs one process's sums): a few ulps of values of order 1, far below 1e-10.
"""

from __future__ import annotations

import copy

import pytest
import torch

from raggedvl.gradcache import grad_cache_step
from tests.dist.harness import run_distributed
from tests.gradcache.test_grad_cache import make_loss_fn, max_diff, pair_batches, plain_step, tiny_model

pytestmark = pytest.mark.dist

ROWS = {0: [0, 1, 2], 1: [3, 4], 2: [5], 3: [6, 7]}
SHARD_DEGREE = 2
BUDGET = 25


def _global_loss(loss: torch.Tensor) -> float:
    import torch.distributed as dist

    t = loss.detach().clone()
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


def _norm(model) -> float:
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))  # the loop's call, measuring only
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


def _hsdp_checks(rank: int, world_size: int) -> dict:
    from raggedvl.parallel.wrap import wrap_model

    out: dict = {}
    model = tiny_model()
    reference = copy.deepcopy(model)
    queries, docs = pair_batches(sum(ROWS.values(), []))
    ref_loss, ref = plain_step(reference, queries, docs, make_loss_fn("late_interaction", gather_across_ranks=False))
    ref_norm = _norm(reference)
    sharded = wrap_model(model, strategy="hsdp", shard_degree=SHARD_DEGREE, timeout_s=600)

    weight = sharded.get_parameter(next(n for n, p in sharded.named_parameters() if p.ndim == 2))
    out["mesh"] = (weight.device_mesh.mesh_dim_names, weight.device_mesh.mesh.tolist(), str(weight.placements))
    out["local_rows"] = (weight.to_local().shape[0], weight.shape[0])

    queries, docs = pair_batches(ROWS[rank])
    loss, _ = plain_step(sharded, queries, docs, make_loss_fn("late_interaction"))
    full = {n: p.grad.full_tensor() for n, p in sharded.named_parameters() if p.requires_grad}
    out["plain/grad"] = max_diff(ref, full)
    out["plain/loss"] = abs(_global_loss(torch.tensor(loss, dtype=torch.float64)) - ref_loss)
    out["plain/norm"] = abs(_norm(sharded) - ref_norm)

    sharded.zero_grad(set_to_none=True)
    step = grad_cache_step(sharded, queries, docs, make_loss_fn("late_interaction"), budget=BUDGET)
    full = {n: p.grad.full_tensor() for n, p in sharded.named_parameters() if p.requires_grad}
    out["grad_cache/grad"] = max_diff(ref, full)
    out["grad_cache/loss"] = abs(_global_loss(step.loss) - ref_loss)
    out["grad_scale"] = max(float(g.abs().max()) for g in ref.values())
    return out


def test_hsdp_2x2_gradients_equal_a_single_process():
    results = run_distributed(_hsdp_checks, 4, timeout=300)
    for rank, res in enumerate(results):
        names, layout, placements = res["mesh"]
        assert names == ("replicate", "shard") and layout == [[0, 1], [2, 3]], res["mesh"]
        assert placements == "(Replicate(), Shard(dim=0))", placements
        local, total = res["local_rows"]
        assert local == total // SHARD_DEGREE, (rank, local, total)  # half the rows: sharded over 2, not 4
        assert res["grad_scale"] > 1e-3  # the compared gradients are not all ~0
        for key in ("plain/grad", "plain/loss", "plain/norm", "grad_cache/grad", "grad_cache/loss"):
            assert res[key] < 1e-10, (rank, key, res[key])

"""Tier 3: the ragged all-gathers on two real gloo processes (one launch, many checks).

Values, counts, offsets and the backward (gradient summed back to the owner) are compared
against what a single process computes from every rank's seeded data; the shape agreement
check must raise the same readable error on both ranks instead of hanging, and a collective
that one rank never joins must fail within the group's timeout.
"""

import os
import socket
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from raggedvl.parallel import all_gather_packed, all_gather_padded, all_gather_variable, init_distributed, shutdown
from tests.dist.harness import rank_slowdown, run_distributed

f64 = torch.float64


def _rows(rank, n, *rest, seed=0):
    g = torch.Generator().manual_seed(seed * 10 + rank)
    return torch.randn(n, *rest, generator=g, dtype=f64)


def _expect_error(fn, error=ValueError):
    try:
        fn()
    except error as exc:
        return str(exc)
    return None


def _variable_checks(rank, world):
    counts = [3, 1]
    x = _rows(rank, counts[rank], 2, 4).requires_grad_(True)
    out = all_gather_variable(x, tag="rows")
    expected = torch.cat([_rows(r, counts[r], 2, 4) for r in range(world)])
    weights = [_rows(r, sum(counts), 2, 4, seed=5) for r in range(world)]  # rank-specific loss
    (out.values * weights[rank]).sum().backward()
    own = slice(out.offsets[rank], out.offsets[rank] + counts[rank])
    grad_expected = sum(w[own] for w in weights)
    empty = all_gather_variable(_rows(rank, [2, 0][rank], 3))
    nothing = all_gather_variable(torch.zeros(0, 3, dtype=f64))
    ints = all_gather_variable(torch.arange(rank + 1) + 10 * rank)
    flags = all_gather_variable(torch.tensor([rank == 0, True, False][: rank + 2]))
    return {
        "values": torch.equal(out.values, expected),
        "counts": out.counts == counts and out.offsets == [0, 3],
        "grad": torch.allclose(x.grad, grad_expected, rtol=0, atol=1e-12),
        "empty rank": empty.counts == [2, 0] and torch.equal(empty.values, _rows(0, 2, 3)),
        "all empty": nothing.values.shape == (0, 3) and nothing.counts == [0, 0],
        "int64": ints.values.tolist() == [0, 10, 11],
        "bool": flags.values.tolist() == [True, True, False, True, False],
    }


def _padded_checks(rank, world):
    counts, lengths = [2, 1], [700, 300]  # C06
    x = _rows(rank, counts[rank], lengths[rank], 3).requires_grad_(True)
    mask = torch.ones(counts[rank], lengths[rank], dtype=torch.bool)
    mask[:, : rank + 1] = False  # left padding inside the local tensor too
    out = all_gather_padded(x, mask, tag="docs")
    parts = [_rows(r, counts[r], lengths[r], 3) for r in range(world)]
    weights = [_rows(r, 3, 700, 3, seed=9) for r in range(world)]
    (out.values * weights[rank]).sum().backward()
    o = out.offsets[rank]
    grad_expected = sum(w[o:o + counts[rank], : lengths[rank]] for w in weights)
    return {
        "padded shape": tuple(out.values.shape) == (3, 700, 3) and tuple(out.mask.shape) == (3, 700),
        "padded values": torch.equal(out.values[:2], parts[0]) and torch.equal(out.values[2, :300], parts[1][0]),
        "pads are zero": bool((out.values[2, 300:] == 0).all()),
        "mask": out.mask[:2, 0].tolist() == [False, False] and out.mask[:2, 1].all().item()
        and out.mask[2, :2].tolist() == [False, False] and out.mask[2, 2:300].all().item()
        and not out.mask[2, 300:].any().item(),
        "padded grad": torch.allclose(x.grad, grad_expected, rtol=0, atol=1e-12),
    }


def _packed_checks(rank, world):
    """all_gather_packed: each row's real vectors first, in order, the rebuilt mask, and the
    gradient of the real vectors back to their owner (what MaxSim sees is the padded gather's)."""
    counts, lengths = [2, 1], [7, 3]
    masks = []
    for r in range(world):
        m = torch.ones(counts[r], lengths[r], dtype=torch.bool)
        m[:, : r + 1] = False  # left padding
        m[0, -1] = False  # and a hole at the end of the first row
        masks.append(m)
    x = _rows(rank, counts[rank], lengths[rank], 3).requires_grad_(True)
    out = all_gather_packed(x, masks[rank], tag="docs")
    parts = [_rows(r, counts[r], lengths[r], 3) for r in range(world)]
    rows = [p[b][m[b]] for p, m in zip(parts, masks) for b in range(p.shape[0])]
    longest = max(len(v) for v in rows)
    weights = [_rows(r, 3, longest, 3, seed=9) for r in range(world)]
    (out.values * weights[rank]).sum().backward()
    o = out.offsets[rank]
    grad_expected = torch.zeros_like(x)
    for b in range(counts[rank]):
        real = masks[rank][b]
        grad_expected[b, real] = sum(w[o + b, : int(real.sum())] for w in weights)
    return {
        "packed shape": tuple(out.values.shape) == (3, longest, 3) and out.counts == counts and out.offsets == [0, 2],
        "packed values": all(torch.equal(out.values[i, : len(v)], v) and bool((out.values[i, len(v):] == 0).all())
                             for i, v in enumerate(rows)),
        "packed mask": [int(m.sum()) for m in out.mask] == [len(v) for v in rows]
        and all(bool(m[: len(v)].all()) for m, v in zip(out.mask, rows)),
        "packed grad": torch.allclose(x.grad, grad_expected, rtol=0, atol=1e-12),
    }


def _agreement_checks(rank, world):
    wrong_dim = _expect_error(lambda: all_gather_variable(torch.zeros(2, 4 + rank)))
    wrong_dtype = _expect_error(
        lambda: all_gather_variable(torch.zeros(1, 4, dtype=[torch.float32, f64][rank]))
    )
    wrong_ndim = _expect_error(lambda: all_gather_padded(torch.zeros(1, 2, *[3] * (rank + 1)),
                                                         torch.ones(1, 2, dtype=torch.bool)))
    os.environ["RAGGEDVL_DEBUG_COLLECTIVES"] = "1"
    wrong_tag = _expect_error(lambda: all_gather_variable(torch.zeros(1, 4), tag=["docs", "queries"][rank]))
    del os.environ["RAGGEDVL_DEBUG_COLLECTIVES"]
    same_tag_ok = all_gather_variable(torch.zeros(1, 4), tag="docs", debug=True).counts == [1, 1]
    with torch.set_grad_enabled(rank == 1):
        wrong_mode = _expect_error(lambda: all_gather_variable(torch.zeros(1, 4)))
    # rank 1's rows need no gradient, rank 0's do: rank 1 must still join the backward all_reduce
    x = torch.ones(1 - rank, 4, dtype=f64, requires_grad=rank == 0)
    joined = all_gather_variable(x)
    (joined.values * 3).sum().backward()
    join_ok = joined.values.requires_grad and (rank == 1 or bool((x.grad == 6).all()))
    info = init_distributed()
    return {
        "trailing dim error": wrong_dim,
        "dtype error": wrong_dtype,
        "ndim error": wrong_ndim,
        "tag error": wrong_tag,
        "grad mode error": wrong_mode,
        "rank without grad joins backward": join_ok,
        "debug passes when ranks agree": same_tag_ok,
        "init reuses group": (info.rank, info.world_size, info.backend, info.device.type) == (rank, 2, "gloo", "cpu"),
    }


def _timeout_check(rank, world):
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=2))
    if rank == 1:
        time.sleep(4)  # never joins the gather
        return None
    start = time.monotonic()
    message = _expect_error(lambda: all_gather_variable(torch.zeros(1, 2), group=group), RuntimeError)
    return message, time.monotonic() - start, rank_slowdown()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env_init_check(rank, world, backend=None):
    """Leave the harness's group, then join a fresh one the torchrun way (env://)."""
    port = [_free_port() if rank == 0 else None]
    dist.broadcast_object_list(port, src=0)
    dist.destroy_process_group()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port[0]))
    info = init_distributed(timeout_s=30, backend=backend)
    x = torch.full((rank + 1, 2), float(rank), device=info.device, requires_grad=True)
    out = all_gather_variable(x)
    out.values.sum().backward()  # every rank's copy sends 1 back: the owner's gradient is W
    result = (info.backend, info.device.type, info.world_size, info.rank == rank,
              out.values.tolist() == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]],
              bool((x.grad == world).all()))
    shutdown()
    return result


def _all_checks(rank, world):
    return {**_variable_checks(rank, world), **_padded_checks(rank, world), **_packed_checks(rank, world),
            **_agreement_checks(rank, world), "timeout": _timeout_check(rank, world),
            "env init": _env_init_check(rank, world, backend="gloo")}


@pytest.fixture(scope="module")
def results():
    return run_distributed(_all_checks, 2)


BOOL_CHECKS = ["values", "counts", "grad", "empty rank", "all empty", "int64", "bool", "padded shape",
               "padded values", "pads are zero", "mask", "padded grad", "packed shape", "packed values",
               "packed mask", "packed grad", "debug passes when ranks agree",
               "init reuses group", "rank without grad joins backward"]


@pytest.mark.dist
@pytest.mark.parametrize("check", BOOL_CHECKS)
def test_gather_check_holds_on_both_ranks(results, check):
    assert [r[check] for r in results] == [True, True]


@pytest.mark.dist
def test_shape_disagreement_raises_on_every_rank_listing_every_shape(results):
    for r in results:
        assert "rank 0: float32 [2, 4]; rank 1: float32 [2, 5]" in r["trailing dim error"]
        assert "dims [1] must be equal" in r["trailing dim error"]
        assert "rank 0: float32 [1, 4]; rank 1: float64 [1, 4]" in r["dtype error"]
        assert "rank 0: float32 [1, 2, 3]; rank 1: float32 [1, 2, 3, 3]" in r["ndim error"]
        assert "different tags" in r["tag error"]
        assert "grad mode differs (rank 0: off, rank 1: on)" in r["grad mode error"]


@pytest.mark.dist
def test_init_distributed_joins_a_gloo_group_from_torchrun_environment(results):
    assert [r["env init"] for r in results] == [("gloo", "cpu", 2, True, True, True)] * 2


@pytest.mark.dist
@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL between processes needs 2 GPUs")
def test_init_distributed_picks_nccl_and_gathers_on_gpus():
    results = run_distributed(_env_init_check, 2)
    assert results == [("nccl", "cuda", 2, True, True, True)] * 2


@pytest.mark.dist
def test_gather_that_one_rank_skips_fails_within_group_timeout(results):
    message, elapsed, slow = results[0]["timeout"]
    # the 2 s group timeout, plus raising the error (CPU work: 2 s x the measured slowdown)
    assert message is not None and elapsed < 2.0 + 2.0 * slow, (message, elapsed, slow)

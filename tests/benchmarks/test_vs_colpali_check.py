"""``benchmarks/vs_colpali.py --check``: the side-by-side benchmark's arguments, command lines,
workloads and simulation, validated in the project's own venv (the benchmark itself runs in the
venv ``benchmarks/vs_colpali.sh`` builds, outside ``make test``)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

from colpali_bench.simulate import simulate  # noqa: E402

from tests.jobs import run_job  # noqa: E402


@pytest.fixture(scope="module")
def check_run():
    # one process: 300 s from launch, stretched by the machine's measured slowdown (tests/jobs.py)
    return run_job([sys.executable, str(REPO / "benchmarks" / "vs_colpali.py"), "--check", "--train-pairs", "10", "--dev-pairs", "2"],
                   ready=None, timeout=300, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.slow
def test_check_validates_every_configuration_and_builds_both_workloads(check_run):
    out = check_run.stdout
    assert check_run.returncode == 0, out[-3000:] + check_run.stderr[-3000:]
    assert out.rstrip().endswith("check: ok")
    # (a) on 1 and 2 processes and (b) on 2: raggedvl's own parser accepted the flags
    for label in ("uniform, 1 proc x 8", "uniform, 2 proc x 8", "heavy, 2 proc x 8"):
        assert f"check: {label}: raggedvl train flags valid" in out
        # both sides decay the learning rate alike after the same warm-up (raggedvl's default is cosine)
        line = out.split(f"check: {label}: raggedvl train flags valid")[1].split("\n")[0]
        assert "warm-up 3, schedule linear); colpali TrainingArguments valid (lr 0.0005, warm-up 3, schedule linear)" in line
    assert "check: built workload uniform (10 + 2 pairs)" in out and "check: built workload heavy (10 + 2 pairs)" in out
    assert "heavy (train, 10 pairs, max_pixels 1,003,520)" in out
    # raggedvl runs (b) padding-free by default (--raggedvl-args-b '--packing true'), (a) padded
    assert "check: raggedvl padding replay on heavy: doc tokens 0.0 %, query tokens 0.0 %" in out
    uniform = out.split("check: raggedvl padding replay on uniform: ")[1].split("\n")[0]
    assert "query tokens 0.0 %" not in uniform
    # the simulation table has one row per simulated world size
    for w, g in ((2, 16), (8, 64), (64, 512)):
        assert f"| {w} | {g} | 20 |" in out


def test_simulated_balance_never_loses_to_equal_counts_and_respects_the_bound():
    rng = np.random.default_rng(0)
    times = np.exp(rng.normal(0.0, 1.5, 64))  # heavy-tailed per-sample costs
    row = simulate(times, times, world_size=8, per_rank_batch=4, steps=30, seed=0)
    assert row.raggedvl_step_s <= row.equal_step_s
    assert row.raggedvl_step_s >= row.bound_step_s - 1e-12
    same = simulate(np.ones(32), np.ones(32), world_size=4, per_rank_batch=2, steps=10, seed=0)
    assert same.speedup == pytest.approx(1.0)  # equal costs: nothing to balance

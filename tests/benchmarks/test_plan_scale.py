"""``benchmarks/plan_scale.py``: the Qwen2-VL-2B cost model's coefficients from the published
dimensions, and the bytes of one step's gathers on a plan small enough to count by hand."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

from plan_scale import EMBED_DIM, qwen2_vl_2b_cost_model, simulate, step_bytes  # noqa: E402


def test_cost_model_counts_the_published_dimensions():
    model = qwen2_vl_2b_cost_model()
    # decoder: 28 layers x (q and o 1536^2, k and v 1536 x 2 heads x 128, gate/up/down 3 x 1536 x 8960)
    assert model.per_token == 28 * (2 * 1536**2 + 2 * 1536 * 256 + 3 * 1536 * 8960) == 1_310_195_712
    assert model.per_patch_pair == 32 * 2 * 1280  # QK^T and AV per pair of an image's patches, 32 blocks
    # 32 blocks x 12 D^2, the 14 x 14 x 3 x 2 patch embedding, the merger's MLP shared by 4 patches
    assert model.per_patch == 32 * 12 * 1280**2 + 3 * 2 * 14 * 14 * 1280 + (5120**2 + 5120 * 1536) / 4
    assert model.per_sample == 0.0


def test_step_bytes_of_a_two_rank_plan():
    parts = [np.array([0, 1]), np.array([2])]  # rank 0: docs of 10 and 30 tokens; rank 1: 20 tokens
    got = step_bytes(parts, np.array([10, 30, 20]), np.ones(3, dtype=np.int64), value_bytes=2, header_values=13,
                     stats=17)
    # W buffers of the most real tokens of a rank (rank 0: 40) in bf16, and of the most documents' counts (int64)
    assert got["gather"] == 2 * 40 * EMBED_DIM * 2 + 2 * 2 * 8
    assert got["backward"] == 2 * (2 - 1) / 2 * 60 * EMBED_DIM * 2  # ring all-reduce of the [T=60, D] real vectors
    assert got["ragged"] == (10 + 30 + 20) * EMBED_DIM * 2
    assert got["small"] == 2 * 8 * (4 * 13 + 2 * 2 + 3 * 3 + 17)  # headers, keys, grids (1 + 2 rows), stats
    assert got["l_max"] == 30


def test_simulation_balances_equal_samples_exactly():
    costs = np.full(64, 3.0)  # equal samples: every rank gets b of them, max/mean 1
    doc_len = np.full(64, 50)
    row = simulate(costs, costs, doc_len, 4, 2, steps=6, seed=0, value_bytes=2, header_values=13, stats=17)
    assert row["steps"] == 6 and row["g"] == 8
    assert row["max_over_mean"] == 1.0 and row["bound"] == 1.0 and row["max_n"] == 2.0
    assert row["ragged"] == 8 * 50 * EMBED_DIM * 2
    assert row["gather"] == 4 * 2 * 50 * EMBED_DIM * 2 + 4 * 2 * 8

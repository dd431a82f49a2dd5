"""``benchmarks/vs_sentence_transformers.py`` at its smallest: uniform pages, 1 process, batch 2,
3 steps, both sides (sentence-transformers' MultiVectorEncoderTrainer and ``raggedvl train``) from
the same exported folder, through the benchmark's own monitor and tables."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest

from tests.jobs import run_job

REPO = Path(__file__).resolve().parents[2]

pytest.importorskip("sentence_transformers")


@pytest.mark.slow
def test_smallest_configuration_runs_both_sides_and_prints_both_rows(tmp_path):
    out = tmp_path / "results.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / "vs_sentence_transformers.py"), "--workload", "a", "--nproc-a", "1",
           "--per-device-batch", "2", "--steps", "3", "--warmup", "1", "--train-pairs", "8", "--dev-pairs", "2",
           "--work-dir", str(tmp_path / "work"), "--json", str(out)]
    # one training process per side, run one after the other: 600 s from launch, stretched by the
    # machine's measured slowdown (tests/jobs.py)
    result = run_job(cmd, ready=None, timeout=600, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    runs = {r["side"]: r for r in json.loads(out.read_text())["runs"]}
    assert set(runs) == {"sentence-transformers", "raggedvl"}
    for side, run in runs.items():
        assert run["returncode"] == 0
        assert run["settings"]["model"].endswith("-st"), run["settings"]  # the exported folder, both sides
        assert [st["step"] for st in run["steps"]] == [1, 2, 3] and all(st["samples"] == 2 for st in run["steps"])
        assert run["samples_per_s"] > 0 and run["worker_rss_mib"] > 0 and run["pss_sum_mib"] > 0, side
        assert all(math.isfinite(st["loss"]) and st["loss"] > 0 for st in run["steps"]), side
    # the same pages at the same max_pixels: a batch of 2 is the same pixel rows on both sides (the
    # first 8 uniform pairs all resize to one grid, so the sample order does not matter; the HF
    # data loader collates one batch ahead, so sentence-transformers counts 3 or 4 batches)
    st, rv = runs["sentence-transformers"]["padding"], runs["raggedvl"]["padding"]
    assert rv["batches"] == 3 and st["batches"] in (3, 4)
    assert st["pixel_rows"] / st["batches"] == rv["pixel_rows"] / rv["batches"] > 0
    table = result.stdout.split("### uniform, 1 proc x 2")[1]
    rows = [line for line in table.splitlines() if line.startswith("| samples/s, steps 3..N |")]
    st_rate, rv_rate = (float(v) for v in rows[0].split("|")[2:4])
    assert st_rate > 0 and rv_rate > 0
    assert "| uniform, 1 proc x 2 |" in result.stdout.split("### raggedvl / sentence-transformers")[1]

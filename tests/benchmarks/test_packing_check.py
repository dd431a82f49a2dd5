"""``benchmarks/packing.py --check``: the padding-free benchmark runs end to end at tiny sizes and
its three modes give the same loss (the script exits 1 otherwise)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.jobs import run_job

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_check_prints_the_three_modes_with_equal_losses(tmp_path):
    # one process: 600 s from launch, stretched by the machine's measured slowdown (tests/jobs.py)
    done = run_job([sys.executable, str(REPO / "benchmarks" / "packing.py"), "--check", "--cache", str(tmp_path)],
                   ready=None, timeout=600, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in done.stdout.splitlines() if line.startswith("| uniform |")]
    assert [r[2].strip() for r in rows] == ["padded", "packed, per-sequence SDPA", "packed, block-diagonal mask"]
    assert rows[0][3].strip() != "0 % / 0 %" and all(r[3].strip() == "0 % / 0 %" for r in rows[1:])
    assert rows[0][6].strip() == "1.00x"
    assert all(float(r[7]) < 1e-4 for r in rows)
    assert "load before:" in done.stdout and "load after:" in done.stdout

"""``tools/gpu_check.py --dry-run``: the prepared GPU check runs its CPU-safe parts in CI.

One subprocess run (the script as a user starts it) checks the files it writes, that every
GPU-only part says "skipped: no CUDA", that the CPU-safe checks pass (DataParallel scatter on
two logical replicas: outputs and gradients equal the unsplit batch; sdpa vs eager), that the
``gpu`` tests are found by marker, that packed rows equal the padded batch (packing check), and
that the timing modes of the tiny model ran (ragged / pad-per-image, plain / GradCache, packed).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests.jobs import run_job

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    # start-up (interpreter, project and torch imports) ends with the "[env] device" row; the
    # checks then get 300 s (tests/jobs.py; ~35 s of CPU on an idle machine)
    done = run_job([sys.executable, str(REPO / "tools" / "gpu_check.py"), str(out), "--dry-run"],
                   ready=r"\[env\] device:", timeout=300, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})
    report = json.loads((out / "gpu_check.json").read_text()) if (out / "gpu_check.json").is_file() else None
    return done, out, report


def _rows(report, part):
    return {r["item"]: r for r in report["rows"] if r["part"] == part}


def test_dry_run_exits_cleanly_and_writes_its_files(dry_run):
    done, out, report = dry_run
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.json", "gpu_check.log", "gpu_check.md", "pytest_gpu.log"]
    table = (out / "gpu_check.md").read_text()
    assert "| part | item | result | samples/s | peak GiB |" in table
    assert table.count("\n| ") == len(report["rows"]) + 1  # header + one line per row
    assert table.strip() in (out / "gpu_check.log").read_text()  # the log holds the printed table
    assert "(dry run)" in report["header"][0] and any(h.startswith("device: cpu") for h in report["header"])


def test_dry_run_reports_environment_and_skips_gpu_only_parts(dry_run):
    _, _, report = dry_run
    env = _rows(report, "env")
    assert env["project"]["result"] == env["packages"]["result"] == "pass"
    assert "torch " in env["packages"]["detail"] and "transformers " in env["packages"]["detail"]
    tests = _rows(report, "tests")["pytest -m gpu"]
    assert tests["result"] == "skipped: no CUDA"
    assert int(tests["detail"].split()[0]) >= 3  # the gpu-marked tests were found by marker
    checks = _rows(report, "checks")
    for name in ("RaggedDataParallel device_ids=[0, 0]", "bf16 autocast vs fp32"):
        assert checks[name]["result"] == "skipped: no CUDA"
    assert _rows(report, "timing")["mid (text 1024x8, vision depth 8)"]["result"] == "skipped: no CUDA"


def test_dry_run_cpu_safe_checks_pass(dry_run):
    _, _, report = dry_run
    checks = _rows(report, "checks")
    scatter = checks["DataParallel scatter, 2 logical replicas on one device"]
    assert scatter["result"] == "pass", scatter["detail"]
    assert "shards [2, 2]" in scatter["detail"]
    attention = checks["attention: sdpa / flash-attn vs eager"]
    assert attention["result"] == "pass" and "flash_attention_2 -> sdpa" in attention["detail"]
    packing = checks["packing: packed vs padded rows"]
    assert packing["result"] == "pass", packing["detail"]
    assert "-> 0 %; fp32 sdpa" in packing["detail"] and "flash_attention_2: n/a" in packing["detail"]


def test_dry_run_times_the_modes_of_the_tiny_model(dry_run):
    _, _, report = dry_run
    timing = _rows(report, "timing")
    modes = [f"tiny, {b}, {m}" for b in ("ragged", "pad-per-image") for m in ("plain", "GradCache")]
    for mode in modes:
        row = timing[mode]
        assert row["result"] == "pass", (mode, row)
        assert row["samples_per_s"] > 0 and row["speed_ratio"] > 0
    assert timing[modes[0]]["speed_ratio"] == 1.0  # the reference row
    for mode in ("tiny, ragged, packed, plain", "tiny, ragged, packed, GradCache"):
        assert timing[mode]["result"] == "pass" and "0.0% padding tokens" in timing[mode]["detail"], timing[mode]
    assert "0.0% padding tokens" not in timing[modes[0]]["detail"]  # the padded rows have some
    for mode in ("tiny, ragged, flash_attention_2, plain", "tiny, ragged, packed, flash_attention_2, plain"):
        assert timing[mode]["result"] == "skipped: no CUDA"

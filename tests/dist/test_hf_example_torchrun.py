"""The README's `torchrun --nproc_per_node 2 examples/train_retriever_hf.py` command runs (DDP,
with evaluation before and after on every process)."""

import os
import sys
from pathlib import Path

import pytest

from tests.jobs import run_job

pytestmark = [pytest.mark.dist, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def test_hf_retrieval_example_under_torchrun(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "examples" / "train_retriever_hf.py"), "--max-steps", "2", "--train-pairs", "8",
           "--eval-pairs", "4", "--batch-size", "2", "--logging-steps", "1", "--max-pixels", str(224 * 224),
           "--output-dir", str(tmp_path / "out")]
    # start-up ends when the Trainer (on rank 0, after both ranks joined the group) shows its
    # progress bar at step 0; 300 s from then for evaluation, 2 steps and evaluation again
    out = run_job(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), ready=r"\| 0/2 \[", timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "over 2 steps (2 process(es)" in out.stdout
    assert out.stdout.count("dev before: nDCG@5") == 1 and out.stdout.count("dev after: nDCG@5") == 1

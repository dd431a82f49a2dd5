"""`raggedvl train --rebalance-vision true` under torchrun (2 gloo processes): the per-step losses of
the run without rebalancing (float32), the plan's tower balance in metrics.jsonl, and evaluation
(sharded, rebalancing off there) still runs. The rdocs pages of the tiny preset are all resized to
the same cap, so the plan moves nothing here: this proves the wiring (a grid all-gather in every
encode on both ranks, no hang, same losses); the exchange itself is proven exact by
tests/dist/test_vision_rebalance_dist.py."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.dist, pytest.mark.slow]

COMMON = [
    "--max-steps", "3", "--checkpoint-every", "100", "--max-train-samples", "16", "--max-eval-samples", "8",
    "--global-batch-size", "4", "--eval-before", "false", "--eval-after", "true", "--eval-train-samples", "4",
    "--log-every", "1",
]


def _train(run_dir, cache, rebalance: bool) -> list[dict]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "raggedvl.app.cli", "train", *COMMON, "--output-dir", str(run_dir), "--data-cache", str(cache),
           "--rebalance-vision", str(rebalance).lower()]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_rebalanced_training_logs_the_losses_of_the_plain_run(tmp_path, small_data_cache):
    plain = _train(tmp_path / "plain", small_data_cache, False)
    moved = _train(tmp_path / "rebalanced", small_data_cache, True)
    loss_plain = [r["loss"] for r in plain if r.get("event") == "train"]
    loss_moved = [r["loss"] for r in moved if r.get("event") == "train"]
    assert len(loss_plain) == len(loss_moved) == 3
    assert max(abs(a - b) for a, b in zip(loss_plain, loss_moved)) < 1e-4, (loss_plain, loss_moved)
    balance = [r["vision_max_over_mean"] for r in moved if r.get("event") == "train"]
    assert all(after <= before + 1e-9 for before, after in balance), balance
    assert all("vision_max_over_mean" not in r for r in plain)
    assert any(r.get("event") == "eval_after" for r in moved)
    print("tower max/mean per step (before, after):", balance, "images moved:",
          [r["vision_images_moved"] for r in moved if r.get("event") == "train"])

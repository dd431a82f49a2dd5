"""`raggedvl train` on rows with two positives each and 0..2 hard negatives per row (the loss
path is proven exact against the float64 reference in tests/dist/test_ragged_objective_dist.py
and tests/dist/test_losses_dist.py): the CLI trains on 1 and 2 processes, metrics.jsonl counts
the masked pairs and each step's own hard negatives, the chance value counts the candidates
left, and a resumed run with a positive drawn per epoch repeats the uninterrupted run."""

from __future__ import annotations

import io
import json
import math
import os
import shutil
import subprocess
import sys

import pytest
from PIL import Image

from raggedvl.app.checkpoint import list_checkpoints
from raggedvl.app.config import TrainConfig
from raggedvl.app.loop import train
from raggedvl.data.positives import drawn_positive

pytestmark = pytest.mark.slow  # tiny model, a few training steps

ROWS = 6
# row i's positives are pages 2i and 2i + 1; its hard negatives (page numbers), 0..2 per row
NEGATIVES = [[], [0], [5, 11], [], [1], [3, 8]]
# masked per step whatever positive each row draws: query 0's other page is a hard negative (rows 1
# and 4 hold both its pages), and one page each of queries 1, 2, 4, 5 (query 2's own negative 5 included)
MASKED = {0: 2, 1: 1, 2: 1, 3: 0, 4: 1, 5: 1}


def _page(p: int) -> dict:
    image = Image.new("RGB", (112 + 28 * (p % 3), 140), (37 * p % 256, 120, 200 - 15 * p))
    image.paste((255, 255, 255), (8 * p, 10, 8 * p + 30, 40))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return {"bytes": buffer.getvalue(), "path": None}


def pages_parquet(path) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    table = pa.table({"query": [f"question {i}" for i in range(ROWS)],
                      "image": pa.array([[_page(2 * i), _page(2 * i + 1)] for i in range(ROWS)], type=pa.list_(image)),
                      "negs": pa.array([[_page(p) for p in row] for row in NEGATIVES], type=pa.list_(image))})
    pq.write_table(table, str(path))
    return str(path)


def _settings(data, cache, out, **extra) -> dict:
    settings = dict(dataset=data, negatives_column="negs", positive_sampling="random", max_steps=4,
                    global_batch_size=ROWS, warmup_steps=1, eval_before=False, eval_after=False, checkpoint_every=2,
                    max_train_samples=None, max_eval_samples=None, output_dir=str(out), data_cache=str(cache))
    return {**settings, **extra}


def _steps(run_dir):
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r.get("event") == "train"]


def test_one_process_masks_every_positive_counts_each_rows_negatives_and_resumes_identically(tmp_path, small_data_cache):
    data = pages_parquet(tmp_path / "pairs.parquet")
    seed = TrainConfig().seed
    draws = [[drawn_positive(2, "random", seed=seed, epoch=e, row=r) for r in range(ROWS)] for e in range(4)]
    assert len({tuple(d) for d in draws}) > 1  # one step per epoch: the steps train against other positives
    straight = tmp_path / "straight"
    summary = train(TrainConfig(**_settings(data, small_data_cache, straight)))
    steps = _steps(straight)
    candidates = 2 * ROWS  # per query: the global batch's positives, then its hard negatives (6)
    chance = sum(math.log(candidates - MASKED[q]) for q in range(ROWS)) / ROWS
    for r in steps:
        assert r["false_negatives"] == sum(MASKED.values())
        assert r["hard_negatives"] == sum(map(len, NEGATIVES))
        assert r["chance_loss"] == pytest.approx(chance)
    assert summary["false_negatives"] == 4 * sum(MASKED.values())
    kept = train(TrainConfig(**_settings(data, small_data_cache, tmp_path / "keep", false_negatives="keep", max_steps=1)))
    assert kept["false_negatives"] == 0 and _steps(tmp_path / "keep")[0]["chance_loss"] == pytest.approx(math.log(candidates))
    resumed = tmp_path / "resumed"  # stop after step 2, resume: steps 3 and 4 (epochs 2 and 3) repeat exactly
    shutil.copytree(straight, resumed)
    for ckpt in list_checkpoints(resumed / "checkpoints"):
        if ckpt.name != "step-000002":
            shutil.rmtree(ckpt)
    train(TrainConfig(**_settings(data, small_data_cache, resumed, resume=True)))
    again = {r["step"]: r["loss"] for r in _steps(resumed)}
    for r in steps[2:]:
        assert again[r["step"]] == pytest.approx(r["loss"], rel=1e-6), r["step"]  # same ops on the same inputs


@pytest.mark.dist
def test_two_processes_train_the_same_objective_as_one(tmp_path, small_data_cache):
    """The sampler splits the rows and their unequal negatives over two ranks; step 1 starts from
    identical weights on both runs, so its loss agrees up to float32 reduction-order rounding."""
    data = pages_parquet(tmp_path / "pairs.parquet")
    one = tmp_path / "one"
    train(TrainConfig(**_settings(data, small_data_cache, one, max_steps=2)))
    two = tmp_path / "two"
    cmd = [sys.executable, "-m", "raggedvl", "train", "--dataset", data, "--negatives-column", "negs",
           "--positive-sampling", "random", "--max-steps", "2", "--global-batch-size", str(ROWS), "--warmup-steps", "1",
           "--eval-before", "false", "--eval-after", "false", "--checkpoint-every", "2", "--max-train-samples", "none",
           "--max-eval-samples", "none", "--nproc-per-node", "2", "--output-dir", str(two),
           "--data-cache", str(small_data_cache)]
    done = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    first_one, first_two = _steps(one)[0], _steps(two)[0]
    assert len(first_two["rank_samples"]) == 2 and sum(first_two["rank_samples"]) == ROWS
    assert [r["false_negatives"] for r in _steps(two)] == [r["false_negatives"] for r in _steps(one)] == [6, 6]
    assert [r["hard_negatives"] for r in _steps(two)] == [sum(map(len, NEGATIVES))] * 2
    assert first_two["loss"] == pytest.approx(first_one["loss"], rel=1e-5)

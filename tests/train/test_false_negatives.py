"""`raggedvl train` removes false negatives: two questions about one page never push each other's
page away. The training step's loss is the loss module's keyed path (proven exact against the
float64 reference and across gloo ranks in tests/losses and tests/dist/test_losses_dist.py);
here: the keys travel from the stored pages through the collator into the step, metrics.jsonl
counts the masked pairs and the chance value counts only the candidates left, on 1 and 2
processes."""

from __future__ import annotations

import io
import json
import math
import os
import subprocess
import sys

import pytest
import torch
from PIL import Image

from raggedvl.app.config import TrainConfig
from raggedvl.parallel import init_distributed
from raggedvl.app.loop import Trainer, train

pytestmark = pytest.mark.slow  # tiny model, a few training steps

PAGES, QUERIES_PER_PAGE = 4, 2


def shared_pages_parquet(path) -> str:
    """``PAGES`` distinct pages, each the positive of ``QUERIES_PER_PAGE`` rows (stored twice,
    byte-identical), with distinct query texts."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pages = []
    for p in range(PAGES):
        image = Image.new("RGB", (112 + 28 * p, 140), (60 * p % 256, 120, 200 - 40 * p))
        image.paste((255, 255, 255), (10 * p, 10, 10 * p + 40, 50))
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        pages.append(buffer.getvalue())
    rows = [(f"question {q} about page {p}", pages[p]) for p in range(PAGES) for q in range(QUERIES_PER_PAGE)]
    image_type = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    table = pa.table({"query": [q for q, _ in rows],
                      "image": pa.array([{"bytes": b, "path": None} for _, b in rows], type=image_type)})
    pq.write_table(table, str(path))
    return str(path)


def _cfg(tmp_path, data, name, **extra):
    settings = dict(dataset=data, max_steps=2, global_batch_size=PAGES * QUERIES_PER_PAGE, warmup_steps=1,
                    eval_before=False, eval_after=False, checkpoint_every=100, max_train_samples=None,
                    max_eval_samples=None, output_dir=str(tmp_path / name))
    return TrainConfig(**{**settings, **extra})


def _steps(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("event") == "train"]


def test_the_step_masks_the_other_question_of_each_page(tmp_path, small_data_cache):
    data = shared_pages_parquet(tmp_path / "pairs.parquet")
    trainer = Trainer(_cfg(tmp_path, data, "run", data_cache=str(small_data_cache)), init_distributed())
    indices = next(iter(trainer.c.sampler))
    batch = trainer.c.collate([trainer.c.train_set[i] for i in indices])
    pages = [trainer.c.train_set.records[i]["query"].rsplit(" ", 1)[-1] for i in indices]
    same_page = [[a == b for b in pages] for a in pages]
    keys = batch["doc_keys"].tolist()
    assert [[a == b for b in keys] for a in keys] == same_page  # equal keys exactly for the same stored page
    assert len(set(batch["query_keys"].tolist())) == len(indices)  # every question differs
    model = trainer.c.model.train()
    with torch.no_grad():  # before the step changes the weights
        q, d = (model(**batch[key]) for key in ("queries", "docs"))
        expected = float(trainer.c.loss(q, d, doc_keys=batch["doc_keys"], query_keys=batch["query_keys"]))
        kept = float(trainer.c.loss(q, d))
    result = trainer.train_step(batch)
    # same weights, same inputs, one encode: float32 rounding of a different batch composition only
    assert result.loss == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert abs(result.loss - kept) > 1e-4  # the masked pairs do change the loss
    assert result.false_negatives == len(indices) * (QUERIES_PER_PAGE - 1)


def test_metrics_count_false_negatives_and_the_chance_counts_only_candidates_left(tmp_path, small_data_cache):
    data = shared_pages_parquet(tmp_path / "pairs.parquet")
    n = PAGES * QUERIES_PER_PAGE  # the whole set is one global batch: every page twice
    masked = train(_cfg(tmp_path, data, "mask", data_cache=str(small_data_cache)))
    kept = train(_cfg(tmp_path, data, "keep", data_cache=str(small_data_cache), false_negatives="keep"))
    for r in _steps(tmp_path / "mask"):
        assert r["false_negatives"] == n * (QUERIES_PER_PAGE - 1)
        assert r["chance_loss"] == pytest.approx(math.log(n - (QUERIES_PER_PAGE - 1)))
    for r in _steps(tmp_path / "keep"):
        assert r["false_negatives"] == 0
        assert r["chance_loss"] == pytest.approx(math.log(n))
    assert masked["false_negatives"] == 2 * n * (QUERIES_PER_PAGE - 1) and kept["false_negatives"] == 0
    assert "false negatives removed from the loss" in (tmp_path / "mask" / "summary.md").read_text()


@pytest.mark.dist
def test_two_processes_mask_the_same_pairs_as_one(tmp_path, small_data_cache):
    """The pages' two questions are split over two ranks by the sampler; each rank's queries still
    see the other rank's copy of their page as their own. Step 1 starts from identical weights on
    both runs, so its loss agrees up to float32 reduction-order rounding (later steps may drift)."""
    data = shared_pages_parquet(tmp_path / "pairs.parquet")
    one = tmp_path / "one"
    train(_cfg(tmp_path, data, "one", data_cache=str(small_data_cache)))
    two = tmp_path / "two"
    cmd = [sys.executable, "-m", "raggedvl.app.cli", "train", "--dataset", data, "--max-steps", "2", "--global-batch-size",
           str(PAGES * QUERIES_PER_PAGE), "--warmup-steps", "1", "--eval-before", "false", "--eval-after", "false",
           "--checkpoint-every", "100", "--max-train-samples", "none", "--max-eval-samples", "none",
           "--nproc-per-node", "2", "--output-dir", str(two), "--data-cache", str(small_data_cache)]
    done = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    first_one, first_two = _steps(one)[0], _steps(two)[0]
    assert first_two["rank_samples"] != [PAGES * QUERIES_PER_PAGE] and len(first_two["rank_samples"]) == 2
    assert [r["false_negatives"] for r in _steps(two)] == [r["false_negatives"] for r in _steps(one)]
    assert first_two["loss"] == pytest.approx(first_one["loss"], rel=1e-5)


def test_the_start_line_counts_repeated_queries_and_pairs(tmp_path, small_data_cache, capsys):
    import pyarrow.parquet as pq

    data = shared_pages_parquet(tmp_path / "pairs.parquet")
    table = pq.read_table(data)
    doubled = tmp_path / "doubled.parquet"
    rows = table.to_pylist()
    rows += [rows[0], dict(rows[1], image=rows[2]["image"])]  # the same pair again; a query again with another page
    pq.write_table(table.from_pylist(rows, schema=table.schema), str(doubled))
    cfg = _cfg(tmp_path, str(doubled), "run", data_cache=str(small_data_cache), max_steps=1)
    train(cfg)
    captured = capsys.readouterr()
    err = captured.out + captured.err
    assert f"{len(rows)} training pairs (2 repeat an earlier pair's query, 1 of them its page too" in err, err

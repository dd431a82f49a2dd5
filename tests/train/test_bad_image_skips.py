"""`raggedvl train` with on_bad_image="skip": a corrupt image is dropped, warned about with its
id, and counted in the metrics log and the run summary (never silently)."""

import io
import json

import datasets
import pytest
from PIL import Image

from raggedvl.train.config import TrainConfig
from raggedvl.train.loop import train

pytestmark = pytest.mark.slow  # builds the tiny tokenizer and trains 2 steps (~30 s)


def _png(size, value) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, (value, 255 - value, 128)).save(buffer, format="PNG")
    return buffer.getvalue()


def test_a_skipped_bad_image_is_counted_in_the_log_and_the_summary(tmp_path, capfd, small_data_cache):
    images = [{"bytes": _png((56 + 8 * i, 56), 20 * i), "path": None} for i in range(8)]
    images[5] = {"bytes": b"\x89PNG\r\n\x1a\n not a png", "path": None}
    features = datasets.Features({"query": datasets.Value("string"), "image": datasets.Image()})
    path = tmp_path / "pairs.parquet"
    datasets.Dataset.from_dict({"query": [f"question {i}" for i in range(8)], "image": images}, features=features).to_parquet(str(path))
    cfg = TrainConfig(dataset=str(path), train_split="train", eval_split="train", max_steps=2, global_batch_size=4,
                      eval_before=False, eval_after=True, on_bad_image="skip", checkpoint_every=100,
                      output_dir=str(tmp_path / "run"), data_cache=str(small_data_cache))
    train(cfg)  # one process: 2 steps of 4 cover all 8 pairs once
    err = capfd.readouterr().err
    assert err.count("skipped example 'train-5'") == 1 and "cannot be decoded" in err
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r.get("event") == "train"]
    assert [r["skipped_examples"] for r in steps][-1] == 1
    assert sum(sum(r["rank_samples"]) for r in steps) == 7  # the skipped pair is not counted as trained
    assert "examples skipped for bad images (on_bad_image='skip'): 1" in (tmp_path / "run" / "summary.md").read_text()
    # evaluation drops the bad pair with its query: 7 queries ranked among 7 documents
    assert "random ranker (7 docs)" in (tmp_path / "run" / "summary.md").read_text()

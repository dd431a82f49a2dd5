"""`raggedvl train` with on_bad_image="skip": a corrupt image is dropped, warned about with its
id, and counted in the metrics log and the run summary (never silently), by the size estimate
(header unreadable: the pair never enters the sampler's plan) and by the collator (pixel data
corrupt, found only when decoding); an extreme strip is not bad.
And the issue-12 reproduction: a parquet with a 2000x2 page trains (it died at startup)."""

import io
import json

import datasets
import pytest
from PIL import Image

from raggedvl.app.cli import main
from raggedvl.data import RetrievalCollator, build_processor
from raggedvl.app.config import TrainConfig
from raggedvl.app.loop import train

pytestmark = pytest.mark.slow  # builds the tiny tokenizer and trains 2-3 steps (~30 s each)


def _png(size, value) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, (value, 255 - value, 128)).save(buffer, format="PNG")
    return buffer.getvalue()


def _parquet(path, images) -> str:
    features = datasets.Features({"query": datasets.Value("string"), "image": datasets.Image()})
    rows = {"query": [f"question {i}" for i in range(len(images))], "image": images}
    datasets.Dataset.from_dict(rows, features=features).to_parquet(str(path))
    return str(path)


def _bad_idat(size, value) -> bytes:
    """A PNG whose header (and IEND chunk) read fine but whose pixel data is corrupt: only
    decoding finds it, so the size estimate keeps the pair and the collator drops it."""
    data = bytearray(_png(size, value))
    at = data.index(b"IDAT")
    length = int.from_bytes(data[at - 4 : at], "big")
    for k in range(at + 6, at + length):
        data[k] ^= 0x5A
    return bytes(data)


def test_a_skipped_bad_image_is_counted_in_the_log_and_the_summary(tmp_path, capfd, small_data_cache):
    images = [{"bytes": _png((56 + 8 * i, 56), 20 * i), "path": None} for i in range(8)]
    images[5] = {"bytes": b"\x89PNG\r\n\x1a\n not a png", "path": None}  # header unreadable
    whole = _png((300, 200), 7)
    images[3] = {"bytes": whole[: len(whole) // 2], "path": None}  # header fine, pixel data cut (no IEND chunk)
    images[6] = {"bytes": _bad_idat((120, 56), 40), "path": None}  # only decoding fails
    images[1] = {"bytes": _png((2000, 2), 0), "path": None}  # a strip: padded, never skipped
    path = _parquet(tmp_path / "pairs.parquet", images)
    cfg = TrainConfig(dataset=path, train_split="train", eval_split="train", max_steps=2, global_batch_size=4,
                      eval_before=False, eval_after=True, on_bad_image="skip", checkpoint_every=100, allow_eval_overlap=True,
                      output_dir=str(tmp_path / "run"), data_cache=str(small_data_cache))
    train(cfg)  # one process: the 6 pairs the estimate kept are 2 steps (4, then 2)
    out, err = capfd.readouterr()
    # each warning names the row and the short cause only: the user passed --on-bad-image skip already
    assert err.count(f"warning: skipping {path} split 'train' row 5 (id 'train-5'): cannot read the image header "
                     "(UnidentifiedImageError: cannot identify image file)\n") == 1, err
    assert err.count(f"warning: skipping {path} split 'train' row 3 (id 'train-3'): truncated PNG (no IEND chunk)\n") == 1, err
    assert "--on-bad-image skip" not in err and "on_bad_image='skip'" not in err and "fix or remove" not in err, err
    # the rejected pairs are out of the sampler's plan: warned about once, never drawn
    assert err.count("'train-5'") == 1 and err.count("'train-3'") == 1, err
    assert "skipped example 'train-5'" not in err and "skipped example 'train-3'" not in err, err
    # a pair whose image fails only when decoded is dropped by the collator, when drawn
    assert err.count("rank 0 skipped example 'train-6': cannot be decoded (OSError: broken data stream") == 1, err
    assert "skipped example 'train-1'" not in err and "(id 'train-1')" not in err
    assert "global batch 4, 6 training pairs (2 more left out: image unreadable)" in out + err
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    estimate = next(r for r in records if r.get("event") == "size_estimate")
    assert estimate["rejected"] == [f"{path} split 'train' row {i} (id 'train-{i}')" for i in (3, 5)]
    assert estimate["kept"] == 6 and estimate["pairs"] == 8
    steps = [r for r in records if r.get("event") == "train"]
    assert [r["skipped_examples"] for r in steps][-1] == 1
    assert sum(sum(r["rank_samples"]) for r in steps) == 5  # 6 kept pairs, less the one the collator dropped
    summary = (tmp_path / "run" / "summary.md").read_text()
    assert "examples skipped for bad images (on_bad_image='skip'): 1" in summary
    assert ("training pairs rejected by the size estimate (image header unreadable or out of limits; never drawn): "
            "2 of 8") in summary
    # evaluation keeps the queries of the bad pairs (their documents can never be retrieved: misses)
    assert "random ranker (8 queries, 8 docs)" in summary
    assert "dev: 3 documents with unreadable images are never retrieved" in summary


def test_rejected_pairs_leave_every_step_full_and_resume(tmp_path, capfd, small_data_cache):
    """9 pairs, one unreadable, global batch 4: the 8 readable pairs are one epoch of 2 full steps
    (before, the plan held the bad pair: a step trained on 3, and the pair was warned about again
    at every draw). A resumed run builds the same plan (the checkpoint's sampler state agrees)."""
    images = [{"bytes": _png((56 + 8 * i, 56), 20 * i), "path": None} for i in range(9)]
    images[5] = {"bytes": b"\x89PNG\r\n\x1a\n not a png", "path": None}
    path = _parquet(tmp_path / "pairs.parquet", images)
    common = dict(dataset=path, train_split="train", global_batch_size=4, eval_before=False, eval_after=False,
                  on_bad_image="skip", checkpoint_every=1, output_dir=str(tmp_path / "run"),
                  data_cache=str(small_data_cache))
    train(TrainConfig(max_steps=1, **common))
    out, err = capfd.readouterr()
    assert "global batch 4, 8 training pairs (1 more left out: image unreadable)" in out + err
    assert err.count("'train-5'") == 1 and "skipped example" not in err, err  # one warning line names it
    train(TrainConfig(max_steps=None, epochs=1, resume=True, **common))  # the rest of the epoch: 1 more step
    out, err = capfd.readouterr()
    assert err.count("'train-5'") == 1 and "skipped example" not in err, err
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("event") == "resume" for r in records)
    steps = [r for r in records if r.get("event") == "train"]
    assert [r["step"] for r in steps] == [1, 2] and [sum(r["rank_samples"]) for r in steps] == [4, 4]
    assert [r["skipped_examples"] for r in steps] == [0, 0]


def test_a_strip_page_trains_from_the_cli_and_the_patch_cap_applies(tmp_path, monkeypatch, small_data_cache):
    """`raggedvl train --dataset strip.parquet` (8 rows, one 2000x2 page) died at startup with
    the estimate's aspect-ratio error. Now it trains; the estimate's patch counts equal the
    collator's rows, and --max-patches-per-rank splits the step that holds the strip."""
    images = [{"bytes": _png((56 + 8 * i, 56), 20 * i), "path": None} for i in range(8)]
    images[2] = {"bytes": _png((2000, 2), 0), "path": None}
    path = _parquet(tmp_path / "strip.parquet", images)
    processor = build_processor("tiny", max_pixels=100_352, cache_dir=small_data_cache)  # the tiny recipe's limit
    collate = RetrievalCollator(processor)
    rows = [int(collate([{"query": "q", "image": image["bytes"], "id": str(i)}])["docs"]["pixel_values"].shape[0])
            for i, image in enumerate(images)]
    cap = max(rows) + 3 * min(rows) - 1  # the strip's step of 4 cannot stay whole under the cap
    monkeypatch.setenv("LOCAL_RANK", "0")  # as under torchrun: train in this process (world size 1)
    code = main(["train", "--dataset", path, "--train-split", "train", "--eval-split", "train", "--max-steps", "none",
                 "--global-batch-size", "4", "--eval-before", "false", "--eval-after", "false",
                 "--max-patches-per-rank", str(cap), "--output-dir", str(tmp_path / "run"),
                 "--data-cache", str(small_data_cache)])
    assert code == 0
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    estimate = next(r for r in records if r.get("event") == "size_estimate")
    assert estimate["patches"] == sum(rows) and estimate["rejected"] == []
    steps = [r for r in records if r.get("event") == "train"]
    assert len(steps) == 3  # 2 global batches of 4; the strip's batch split in two by the cap
    assert sum(sum(r["rank_samples"]) for r in steps) == 8
    assert "examples skipped for bad images (on_bad_image='error'): 0" in (tmp_path / "run" / "summary.md").read_text()

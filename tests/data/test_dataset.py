"""RetrievalDataset and load_retrieval_dataset: rdocs manifests, local parquet, image folders, bad rows."""

from __future__ import annotations

import io
import json

import datasets
import numpy as np
import pytest
from PIL import Image

from raggedvl.data.columns import Columns
from raggedvl.data import BadImageError, RetrievalDataset, load_retrieval_dataset


def _png(size, value) -> bytes:
    buffer = io.BytesIO()
    Image.new("L", size, value).save(buffer, format="PNG")
    return buffer.getvalue()


def _write_parquet(path, rows, image_feature=True):
    features = datasets.Features(
        {"query": datasets.Value("string"), "image": datasets.Image() if image_feature else datasets.Value("string"), "doc_id": datasets.Value("string")}
    )
    datasets.Dataset.from_dict({k: [r[k] for r in rows] for k in ("query", "image", "doc_id")}, features=features).to_parquet(str(path))
    return path


def _rows(n):
    return [{"query": f"question number {i}", "image": {"bytes": _png((40 + 7 * i, 30 + 3 * i), 10 * i), "path": None}, "doc_id": f"d{i}"} for i in range(n)]


def test_manifest_dataset(small_rdocs):
    train = load_retrieval_dataset(small_rdocs, "train")
    dev = RetrievalDataset.from_manifest(small_rdocs, "dev")
    assert (len(train), len(dev)) == (6, 3) and train.split == "train"
    assert not set(train.ids()) & set(dev.ids())
    item = train[0]
    assert isinstance(item["query"], str) and item["query"] and item["id"] == train.ids()[0]
    assert item["image"].mode == "RGB" and item["image"].size == train.image_sizes()[0]
    assert {"pdf", "page", "view", "dpi", "split"} <= set(item)
    with pytest.raises(ValueError, match="splits present"):
        RetrievalDataset.from_manifest(small_rdocs, "test")
    limited = RetrievalDataset.from_manifest(small_rdocs, "train", limit=2)
    assert len(limited) == 2 and set(limited.ids()) <= set(train.ids())
    assert set(limited.ids()) <= set(RetrievalDataset.from_manifest(small_rdocs, "train", limit=4).ids())


def test_local_parquet_with_image_feature(tmp_path):
    rows = _rows(5)
    path = _write_parquet(tmp_path / "train.parquet", rows)
    ds = load_retrieval_dataset(path, "train", columns=Columns(id="doc_id"))
    assert len(ds) == 5 and ds.ids() == [f"d{i}" for i in range(5)]
    assert ds.image_sizes() == [(40 + 7 * i, 30 + 3 * i) for i in range(5)]
    item = ds[3]
    assert item["query"] == "question number 3" and item["image"].mode == "RGB"
    assert item["image"].size == (61, 39) and item["image"].getpixel((0, 0)) == (30, 30, 30)
    assert load_retrieval_dataset(tmp_path, "train").ids() == [f"train-{i}" for i in range(5)]  # a directory of parquet


def test_parquet_with_path_strings(tmp_path):
    for i in range(3):
        (tmp_path / f"p{i}.png").write_bytes(_png((50, 50), 40 * i))
    rows = [{"query": f"query {i} text", "image": f"p{i}.png", "doc_id": str(i)} for i in range(3)]
    ds = load_retrieval_dataset(_write_parquet(tmp_path / "x.parquet", rows, image_feature=False), "train")
    assert ds[2]["image"].getpixel((1, 1)) == (80, 80, 80)
    assert ds.ids() == ["train-0", "train-1", "train-2"]  # a row of a table, not a file of a folder


def test_image_folder(tmp_path):
    """An image folder's rows are named by their files' paths relative to the folder (an id
    column still wins), and a stable sample draws from those names."""
    folder = tmp_path / "folder"
    (folder / "scans").mkdir(parents=True)
    names = ["img0.png", "scans/img1.png", "scans/img2.png"]
    with open(folder / "metadata.jsonl", "w") as handle:
        for i, name in enumerate(names):
            (folder / name).write_bytes(_png((60, 30), 50 * i))
            handle.write(json.dumps({"file_name": name, "query": f"find page {i}", "page": f"page {i}"}) + "\n")
    ds = load_retrieval_dataset(folder, "train")
    by_query = {ds[i]["query"]: ds[i]["image"].getpixel((0, 0)) for i in range(len(ds))}
    assert by_query == {f"find page {i}": (50 * i,) * 3 for i in range(3)}
    by_id = {ds[i]["id"]: ds[i]["image"].getpixel((0, 0)) for i in range(len(ds))}
    assert by_id == {name: (50 * i,) * 3 for i, name in enumerate(names)}
    sample = load_retrieval_dataset(folder, "train", limit=2)
    assert sample.ids() == ds.sample(2).ids() and len(set(sample.ids())) == 2
    assert sorted(load_retrieval_dataset(folder, "train", columns=Columns(id="page")).ids()) == ["page 0", "page 1", "page 2"]
    with pytest.raises(ValueError, match=r"2 ids for 3 rows; pass one id per row"):
        RetrievalDataset.from_hf(datasets.load_dataset(str(folder), split="train"), ids=["a", "b"])


def test_bad_rows_are_named_or_counted(tmp_path):
    with pytest.raises(ValueError, match=r"no column 'qeury'.*did you mean 'query'\? pass Columns\(query=...\)"):
        load_retrieval_dataset(_write_parquet(tmp_path / "a.parquet", _rows(2)), "train", columns=Columns(query="qeury"))

    empty = _rows(3)
    empty[1]["query"] = "   "
    empty[2]["query"] = None  # ViDoRe-style corpus row without a query
    empty_path = _write_parquet(tmp_path / "b.parquet", empty)
    with pytest.raises(ValueError, match=r"row 1 \(id 'train-1'\) has an empty.*pass --on-empty-query skip \(key on_empty_query"):
        load_retrieval_dataset(empty_path, "train")
    kept = load_retrieval_dataset(empty_path, "train", on_empty_query="skip", columns=Columns(id="doc_id"))
    assert kept.ids() == ["d0"] and [r["id"] for r in kept.skipped_rows] == ["d1", "d2"]
    assert kept[0]["image"].size == (40, 30)

    corrupt = _rows(3)
    corrupt[2]["image"] = {"bytes": b"\x89PNG\r\n\x1a\n garbage", "path": None}
    path = _write_parquet(tmp_path / "c.parquet", corrupt)
    strict = load_retrieval_dataset(path, "train", columns=Columns(id="doc_id"))
    assert strict[0]["image"] is not None
    with pytest.raises(BadImageError, match=r"row 2 \(id 'd2'\)"):
        strict[2]
    with pytest.raises(BadImageError, match="d2"):
        strict.image_sizes()
    lenient = load_retrieval_dataset(path, "train", columns=Columns(id="doc_id"), on_bad_image="skip")
    item = lenient[2]
    assert item["image"] is None and "cannot be decoded" in item["image_error"]
    assert lenient.image_sizes()[2] is None and lenient.image_sizes()[0] == (40, 30)
    with pytest.raises(ValueError, match="on_bad_image"):
        load_retrieval_dataset(path, "train", on_bad_image="ignore")


def test_manifest_missing_key(tmp_path):
    (tmp_path / "manifest.jsonl").write_text(json.dumps({"id": "a", "image": "x.png", "split": "train"}) + "\n")
    with pytest.raises(ValueError, match=r"row 0 lacks \['query'\]"):
        load_retrieval_dataset(tmp_path, "train")
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 255, (30, 30), dtype=np.uint8)).save(tmp_path / "x.png")
    (tmp_path / "manifest.jsonl").write_text(json.dumps({"id": "a", "image": "x.png", "split": "train", "query": "two words"}) + "\n")
    assert load_retrieval_dataset(tmp_path, "train").image_sizes() == [(30, 30)]  # header read when the manifest lacks sizes


def test_an_empty_folder_is_refused_in_plain_words(tmp_path):
    from raggedvl.data import load_retrieval_dataset

    with pytest.raises(ValueError) as caught:
        load_retrieval_dataset(tmp_path, split="train")
    message = str(caught.value)
    assert message.startswith(f"{tmp_path} is neither an rdocs directory nor a folder the datasets library can read ("), message
    assert "`" not in message, message

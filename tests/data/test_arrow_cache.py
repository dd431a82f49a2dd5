"""Local parquet read as one memory-mapped Arrow table (raggedvl.data.arrow_cache): the same rows,
ids and image bytes as ``datasets.load_dataset`` gives, no ``datasets`` import, small pickles, a
changed file converted again, differing schemas left to ``datasets``."""

from __future__ import annotations

import io
import os
import pickle
import subprocess
import sys

import datasets
import pyarrow.parquet as pq
import pytest
from PIL import Image

from raggedvl.data.columns import Columns
from raggedvl.data import RetrievalDataset, load_retrieval_dataset
from raggedvl.data.arrow_cache import MappedTable, mapped_split
from raggedvl.data.scan import UnreadableParquet, image_sizes, parquet_split


def _png(size, value) -> bytes:
    buffer = io.BytesIO()
    Image.new("L", size, value).save(buffer, format="PNG")
    return buffer.getvalue()


def _write(path, start: int, n: int, *, negatives: bool = True, row_group_size: int = 3):
    features = {"query": datasets.Value("string"), "image": datasets.Image(), "doc_id": datasets.Value("string")}
    data = {"query": [f"question {i}" for i in range(start, start + n)],
            "image": [{"bytes": _png((20 + i, 10 + i), i), "path": None} for i in range(start, start + n)],
            "doc_id": [f"d{i}" for i in range(start, start + n)]}
    if negatives:
        features["negs"] = datasets.List(datasets.Image())
        data["negs"] = [[{"bytes": _png((5 + i, 5), i), "path": None}, {"bytes": _png((6, 6 + i), i), "path": None}]
                        for i in range(start, start + n)]
    table = datasets.Dataset.from_dict(data, features=datasets.Features(features)).data.table
    pq.write_table(table, path, row_group_size=row_group_size)  # several row groups per file
    return path


def _view(ds: RetrievalDataset) -> list:
    """Everything a row gives, images as (size, pixel bytes)."""
    out = []
    for i in range(len(ds)):
        item = ds[i]
        out.append((item["id"], item["query"], item["image"].size, item["image"].tobytes(),
                    [(n.size, n.tobytes()) for n in item["negatives"]]))
    return out


def test_folder_of_parquet_reads_as_datasets_does(tmp_path, monkeypatch):
    monkeypatch.setenv("RAGGEDVL_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "data"
    folder.mkdir()
    _write(folder / "train-00000.parquet", 0, 7)
    _write(folder / "train-00001.parquet", 7, 5)
    _write(folder / "dev.parquet", 100, 4)
    ours = load_retrieval_dataset(folder, "train", columns=Columns(id="doc_id", negatives="negs"), limit=9)
    assert isinstance(ours.image_sources.table, MappedTable)  # read through the Arrow cache
    reference = datasets.load_dataset(str(folder))["train"]
    theirs = RetrievalDataset.from_hf(reference, "train", columns=Columns(id="doc_id", negatives="negs"), limit=9,
                                      base_dir=folder)
    assert len(ours) == 9 and _view(ours) == _view(theirs)
    assert ours.image_sizes() == theirs.image_sizes() and ours.image_digests() == theirs.image_digests()
    assert list(ours.image_inputs()) == list(theirs.image_inputs())  # what a size estimate reads
    dev = load_retrieval_dataset(folder, "dev", columns=Columns(id="doc_id"))
    assert dev.ids() == [f"d{i}" for i in range(100, 104)]
    assert len(list((tmp_path / "cache" / "arrow").glob("*.arrow"))) == 2  # one table per split


def test_local_parquet_needs_no_datasets_import(tmp_path):  # training pairs, an evaluation set, a corpus to encode
    folder = tmp_path / "data"
    folder.mkdir()
    _write(folder / "train.parquet", 0, 4, negatives=False)
    code = ("import sys; from raggedvl.data import Columns, load_retrieval_dataset\n"
            "from raggedvl.evaluation.benchmark import load_benchmark, load_corpus\n"
            f"ds = load_retrieval_dataset({str(folder)!r}, 'train', columns=Columns(id='doc_id'))\n"
            f"bench, docs = load_benchmark({str(folder)!r}, 'train'), load_corpus({str(folder)!r}, 'train')\n"
            "assert len(bench.queries) == len(docs) == 4, (len(bench.queries), len(docs))\n"
            "print(len(ds), ds[3]['image'].size, 'datasets' in sys.modules, 'pandas' in sys.modules)")
    env = {**os.environ, "RAGGEDVL_CACHE": str(tmp_path / "cache")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["4", "(23,", "13)", "False", "False"], out.stdout


def test_pickles_as_a_path_and_maps_again(tmp_path, monkeypatch):
    monkeypatch.setenv("RAGGEDVL_CACHE", str(tmp_path / "cache"))
    _write(tmp_path / "train.parquet", 0, 40, negatives=False)
    ds = load_retrieval_dataset(tmp_path / "train.parquet", "train", columns=Columns(id="doc_id"))
    image_bytes = sum(len(v["bytes"]) for v in ds.image_sources)
    blob = pickle.dumps(ds.image_sources)
    assert len(blob) < image_bytes / 4  # the rows stay in the file, not in the pickle
    again = pickle.loads(blob)
    assert [again[i] for i in range(40)] == [ds.image_sources[i] for i in range(40)]


def test_changed_file_is_converted_again(tmp_path, monkeypatch):
    monkeypatch.setenv("RAGGEDVL_CACHE", str(tmp_path / "cache"))
    path = _write(tmp_path / "train.parquet", 0, 3, negatives=False)
    assert load_retrieval_dataset(path, "train", columns=Columns(id="doc_id")).ids() == ["d0", "d1", "d2"]
    _write(path, 10, 2, negatives=False)
    os.utime(path, ns=(os.stat(path).st_atime_ns, os.stat(path).st_mtime_ns + 10**9))
    assert load_retrieval_dataset(path, "train", columns=Columns(id="doc_id")).ids() == ["d10", "d11"]


def test_differing_schemas_are_left_to_datasets(tmp_path, monkeypatch):
    monkeypatch.setenv("RAGGEDVL_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "data"
    folder.mkdir()
    _write(folder / "train-0.parquet", 0, 2, negatives=False)
    first = pq.read_table(folder / "train-0.parquet")
    pq.write_table(first.select(["doc_id", "query", "image"]).slice(1), folder / "train-1.parquet")  # other column order
    assert mapped_split([folder / "train-0.parquet", folder / "train-1.parquet"]) is None
    ds = load_retrieval_dataset(folder, "train", columns=Columns(id="doc_id"))
    assert not isinstance(ds.image_sources.table, MappedTable)  # datasets read it
    assert ds.ids() == ["d0", "d1", "d1"] and ds[2]["image"].size == (21, 11)


def test_cut_short_cache_file_is_converted_again(tmp_path, monkeypatch):
    """A cache file that lost its end (a crash after the rename, a full disk, a hand edit) is
    rebuilt, not mapped: before, every later run stopped with pyarrow's "Not an Arrow file"."""
    monkeypatch.setenv("RAGGEDVL_CACHE", str(tmp_path / "cache"))
    data = _write(tmp_path / "train.parquet", 0, 5, negatives=False)
    first = mapped_split([data])
    expected = first.table.to_pylist()
    whole = open(first.path, "rb").read()
    for cut in (whole[: len(whole) // 2], b""):
        with open(first.path, "wb") as f:
            f.write(cut)
        again = mapped_split([data])
        assert again.path == first.path  # the same key: the data did not change
        assert again.table.to_pylist() == expected


def _damaged(path):
    """``path`` rewritten with one uncompressed-size-preserving hole: bytes in the middle of its
    data pages zeroed (the footer still reads)."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 3
    data[middle:middle + 200] = bytes(200)
    path.write_bytes(bytes(data))
    return path


@pytest.mark.parametrize("damage", ["cut short", "damaged pages"])
def test_unreadable_parquet_is_one_error_naming_the_file(tmp_path, monkeypatch, damage):
    monkeypatch.setenv("RAGGEDVL_CACHE", str(tmp_path / "cache"))
    path = _write(tmp_path / "train.parquet", 0, 12, negatives=False, row_group_size=4)
    if damage == "cut short":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    else:
        _damaged(path)
    with pytest.raises(UnreadableParquet, match=r"train\.parquet: cannot read this parquet file .*re-write or remove it"):
        load_retrieval_dataset(path, "train", columns=Columns(id="doc_id"))
    if damage == "damaged pages":  # the launcher's header scan reads the same pages
        with pytest.raises(UnreadableParquet, match=r"train\.parquet: cannot read"):
            image_sizes(parquet_split(path, "train"), "image", workers=1)
    assert not list((tmp_path / "cache" / "arrow").glob("*.arrow"))  # nothing half-written is kept

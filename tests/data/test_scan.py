"""raggedvl.data.scan: a local parquet split's files, columns and image sizes, read without
decoding, in parallel, and cached beside the data by file fingerprint."""

import io
import os

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from raggedvl.data.columns import Columns
from raggedvl.data import load_retrieval_dataset
from raggedvl.data import scan
from raggedvl.data.scan import cached_image_sizes, image_sizes, parquet_split
from raggedvl.images import read_size


def _png(width: int, height: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("L", (width, height), 200).save(buffer, format="PNG")
    return buffer.getvalue()


def _write(path, sizes, *, corrupt=(), row_group_size=None):
    """A parquet file with ``datasets``' Image feature: one PNG of each (width, height)."""
    images = [{"bytes": b"not a png" if i in corrupt else _png(*s), "path": None} for i, s in enumerate(sizes)]
    features = datasets.Features({"query": datasets.Value("string"), "image": datasets.Image()})
    table = datasets.Dataset.from_dict({"query": [f"q{i}" for i in range(len(sizes))], "image": images},
                                       features=features).data.table
    pq.write_table(table, str(path), row_group_size=row_group_size)
    return path


SIZES = [(30 + i, 40 + 2 * i) for i in range(12)]


def test_sizes_equal_the_header_reads_and_keep_unreadable_rows(tmp_path):
    path = _write(tmp_path / "pairs.parquet", SIZES, corrupt=(4,), row_group_size=5)
    table = parquet_split(path, "train")
    assert table.num_rows == 12 and table.columns == ("query", "image")
    found = image_sizes(table, "image", workers=1)
    expected = [None if i == 4 else read_size({"bytes": _png(*s), "path": None}) for i, s in enumerate(SIZES)]
    assert [found.size(i) for i in range(12)] == expected
    assert list(found.errors) == [4]
    message = found.message(4, "pairs row 4 (id 'x')")
    assert message.startswith("pairs row 4 (id 'x'): cannot read the image header") and "--on-bad-image skip" in message


def test_worker_processes_give_the_serial_result(tmp_path, monkeypatch):
    path = _write(tmp_path / "pairs.parquet", SIZES, corrupt=(7,), row_group_size=3)
    table = parquet_split(path, "train")
    serial = scan.ImageSizes(*_unpack(image_sizes(table, "image", workers=1)))
    for cached in (tmp_path / ".raggedvl").iterdir():
        cached.unlink()
    monkeypatch.setattr(scan, "PARALLEL_ROWS", 1)
    parallel = image_sizes(table, "image", workers=2)
    np.testing.assert_array_equal(parallel.sizes, serial.sizes)
    assert parallel.errors == serial.errors


def _unpack(result):
    return result.sizes.copy(), dict(result.errors)


def test_the_cache_is_read_back_and_a_changed_file_is_scanned_again(tmp_path, monkeypatch):
    path = _write(tmp_path / "pairs.parquet", SIZES)
    first = image_sizes(parquet_split(path, "train"), "image", workers=1)
    assert len(list((tmp_path / ".raggedvl").glob("sizes-*.npz"))) == 1  # beside the data

    def no_reads(task):
        raise AssertionError("read an image although the cache holds the sizes")

    monkeypatch.setattr(scan, "_scan_part", no_reads)
    again = image_sizes(parquet_split(path, "train"), "image", workers=1)
    np.testing.assert_array_equal(again.sizes, first.sizes)
    monkeypatch.undo()

    _write(path, [(70, 80)] * 3)  # new content, new fingerprint
    os.utime(path, ns=(1, 1))
    table = parquet_split(path, "train")
    assert cached_image_sizes(table, "image") is None
    assert [image_sizes(table, "image").size(i) for i in range(3)] == [(70, 80)] * 3


def test_a_data_folder_that_takes_no_cache_caches_under_the_cache_root(tmp_path, monkeypatch):
    data = tmp_path / "data"
    data.mkdir()
    path = _write(data / "pairs.parquet", SIZES)
    (data / ".raggedvl").write_text("")  # a file where the cache folder would go: writing beside the data fails
    monkeypatch.setenv("RAGGEDVL_CACHE", str(tmp_path / "cache"))
    first = image_sizes(parquet_split(path, "train"), "image", workers=1)
    assert len(list((tmp_path / "cache" / "sizes").glob("sizes-*.npz"))) == 1
    np.testing.assert_array_equal(cached_image_sizes(parquet_split(path, "train"), "image").sizes, first.sizes)


def test_a_folder_split_follows_datasets_file_order_and_names_the_file(tmp_path):
    folder = tmp_path / "folder"
    folder.mkdir()
    _write(folder / "train-00000-of-00002.parquet", SIZES[:5])
    _write(folder / "train-00001-of-00002.parquet", SIZES[5:], corrupt=(2,))
    _write(folder / "dev.parquet", SIZES[:2])
    table = parquet_split(folder, "train")
    assert [f.name for f in table.files] == ["train-00000-of-00002.parquet", "train-00001-of-00002.parquet"]
    assert table.file_rows == (5, 7) and table.file_of(7).name == "train-00001-of-00002.parquet"
    found = image_sizes(table, "image", workers=1)
    assert list(found.errors) == [7]
    assert parquet_split(folder, "validation").num_rows == 2  # dev and validation find each other
    with pytest.raises(ValueError, match="has no split 'test'"):
        parquet_split(folder, "test")


@pytest.mark.parametrize("renamed_to", [["question", "image"], ["query", "picture"]])
def test_a_file_whose_columns_differ_from_the_first_is_named_not_a_traceback(tmp_path, renamed_to):
    """A later file of a split with other columns than the first (whose columns the checks
    read), or a file with a column name twice, is a ValueError naming the file and its columns
    (the launcher's one line), not pyarrow's KeyError when its query or image column is read."""
    folder = tmp_path / "folder"
    folder.mkdir()
    first = _write(folder / "train-00000-of-00002.parquet", SIZES[:3])
    renamed = folder / "train-00001-of-00002.parquet"
    pq.write_table(pq.read_table(_write(renamed, SIZES[3:5])).rename_columns(renamed_to), str(renamed))
    assert scan.read_column(parquet_split(first, "train"), "query") == ["q0", "q1", "q2"]
    with pytest.raises(ValueError) as differ:
        parquet_split(folder, "train")
    assert str(differ.value) == (f"{renamed} has the columns {renamed_to}, {first} has ['query', 'image']: every "
                                 "parquet file of a split must hold the same columns; re-write or remove this file")
    twice = tmp_path / "twice.parquet"
    pq.write_table(pa.table([pa.array(["a"]), pa.array(["b"]), pa.array([b"x"])], names=["query", "query", "image"]),
                   str(twice))
    with pytest.raises(ValueError, match=r"holds columns named \['query'\] more than once \(columns: "
                                         r"\['query', 'query', 'image'\]\); rename or drop the duplicates"):
        parquet_split(twice, "train")


def test_the_loader_takes_the_cached_sizes_so_costs_read_no_image(tmp_path):
    path = _write(tmp_path / "pairs.parquet", SIZES, corrupt=(3,))
    unscanned = load_retrieval_dataset(str(path), on_bad_image="skip")
    assert unscanned.image_inputs() is unscanned.image_sources  # no cache yet: headers are read when needed
    image_sizes(parquet_split(path, "train"), "image", workers=1)
    train = load_retrieval_dataset(str(path), on_bad_image="skip")
    inputs = train.image_inputs()
    assert [inputs[i] for i in range(12) if i != 3] == [read_size({"bytes": _png(*s), "path": None})
                                                        for i, s in enumerate(SIZES) if i != 3]
    assert isinstance(inputs[3], dict)  # the unreadable row: its source, so the estimate names and skips it
    assert train.image_sizes() == unscanned.image_sizes()
    subset = train.select([5, 3])
    assert subset.image_inputs()[0] == inputs[5] and subset.image_sizes()[1] is None


def test_other_sources_are_left_to_the_full_loader(tmp_path):
    (tmp_path / "manifest.jsonl").write_text("")
    assert parquet_split(tmp_path, "train") is None  # an rdocs manifest
    assert parquet_split("org/name", "train") is None  # a hub id
    table = pa.table({"query": ["a"], "image": ["a.png"]})
    (tmp_path / "carded").mkdir()
    pq.write_table(table, str(tmp_path / "carded" / "train.parquet"))
    (tmp_path / "carded" / "README.md").write_text("---\nconfigs: []\n---\n")
    assert parquet_split(tmp_path / "carded", "train") is None  # a dataset card may name other files


def _write_negatives(path, cells):
    """A parquet file whose ``negs`` column holds a list of images per row (None: a null cell)."""
    rows = [None if cell is None else [{"bytes": b"not a png" if s is None else _png(*s), "path": None} for s in cell]
            for cell in cells]
    features = datasets.Features({"query": datasets.Value("string"), "image": datasets.Image(),
                                  "negs": datasets.List(datasets.Image())})
    data = {"query": [f"q{i}" for i in range(len(cells))], "image": [{"bytes": _png(20, 20), "path": None}] * len(cells),
            "negs": rows}
    pq.write_table(datasets.Dataset.from_dict(data, features=features).data.table, str(path), row_group_size=2)
    return path


def test_a_hard_negatives_column_is_scanned_with_each_image_named_and_counted(tmp_path, monkeypatch):
    """A list column (``item``): sizes [N, K, 2] padded with -1, each row's count (0 for a null
    cell), and a corrupt negative's reason names the row's label and its place in the list."""
    cells = [[(30, 40), (31, 41)], [(32, 42)], None, [(33, 43), None], []]
    path = _write_negatives(tmp_path / "pairs.parquet", cells)
    table = parquet_split(path, "train")
    found = image_sizes(table, "negs", workers=1, item="hard negative")
    assert found.sizes.shape == (5, 2, 2) and found.counts.tolist() == [2, 1, 0, 2, 0]
    assert found.sizes[0].tolist() == [[30, 40], [31, 41]] and found.sizes[1].tolist() == [[32, 42], [-1, -1]]
    assert found.sizes[3].tolist() == [[33, 43], [-1, -1]] and list(found.errors) == [3]
    message = found.message(3, "pairs row 3 (id 'x')")
    assert message.startswith("pairs row 3 (id 'x'), hard negative 1: cannot read the image header"), message
    assert "--on-bad-image skip" in message

    monkeypatch.setattr(scan, "_scan_part", lambda task: (_ for _ in ()).throw(AssertionError("read again")))
    again = image_sizes(table, "negs", workers=1, item="hard negative")  # from the cache, counts included
    np.testing.assert_array_equal(again.sizes, found.sizes)
    assert again.counts.tolist() == [2, 1, 0, 2, 0] and again.errors == found.errors
    assert cached_image_sizes(table, "negs") is None  # the same column scanned as one image per row: another key


def test_the_scan_version_is_part_of_the_cache_key(tmp_path, monkeypatch):
    path = _write(tmp_path / "pairs.parquet", SIZES)
    image_sizes(parquet_split(path, "train"), "image", workers=1)
    assert scan.SCAN_VERSION == 3
    assert cached_image_sizes(parquet_split(path, "train"), "image") is not None
    monkeypatch.setattr(scan, "SCAN_VERSION", 2)  # a cache an older raggedvl wrote is not read
    assert cached_image_sizes(parquet_split(path, "train"), "image") is None


def test_the_loader_takes_the_cached_negative_sizes_so_costs_read_no_negative(tmp_path):
    """After the launcher's scan of the hard negatives, a rank's size estimate takes their sizes
    from the cache (also through select and concat); an unreadable one stays a source, so the
    estimate still names it."""
    from raggedvl.data.concat import concat_datasets

    cells = [[(30, 40), (31, 41)], [(32, 42), (33, 43)], [(34, 44), None], [(35, 45), (36, 46)]]
    path = str(_write_negatives(tmp_path / "pairs.parquet", cells))
    before = load_retrieval_dataset(path, columns=Columns(negatives="negs"), on_bad_image="skip")
    assert isinstance(before.image_inputs()[0][1], dict)  # no cache yet: the negatives' sources
    image_sizes(parquet_split(path, "train"), "negs", workers=1, item="hard negative")
    train = load_retrieval_dataset(path, columns=Columns(negatives="negs"), on_bad_image="skip")
    inputs = train.image_inputs()
    assert inputs[0][1:] == [(30, 40), (31, 41)] and inputs[3][1:] == [(35, 45), (36, 46)]
    assert inputs[2][1] == (34, 44) and isinstance(inputs[2][2], dict)  # the corrupt one: its source
    assert train.select([3, 0]).image_inputs()[0][1:] == [(35, 45), (36, 46)]
    both = concat_datasets([train, before], ["a", "b"])
    assert both.image_inputs()[1][1:] == [(32, 42), (33, 43)] and isinstance(both.image_inputs()[5][1], dict)
    assert [im.size for im in train[1]["negatives"]] == [(32, 42), (33, 43)]  # items still decode the images
    from raggedvl.sampling import estimate_costs

    cached, read = (estimate_costs(d.image_inputs(), 32, on_bad_image="skip") for d in (train, before))
    np.testing.assert_array_equal(cached.patches, read.patches)  # the same estimate as from the headers
    assert [s["sample"] for s in cached.skipped] == [s["sample"] for s in read.skipped] == [2]


def test_a_column_of_text_named_as_images_is_refused_and_a_column_of_paths_is_not(tmp_path):
    """check_image_column: the query column, or strings that are neither files nor image names,
    are text (ValueError with the first value and the flag); paths pass, even to missing files
    (those are a BadImageError naming the row later); image structs are not read at all."""
    from raggedvl.app.column_flags import column_fix
    from raggedvl.data.columns import ColumnError
    from raggedvl.data.dataset import RetrievalDataset
    from raggedvl.data.scan import check_image_column

    (tmp_path / "pages").mkdir()
    (tmp_path / "pages" / "a").write_bytes(_png(40, 40))  # an existing file without an extension
    table = pa.table({"query": ["what is on page 0", "page 1?"], "page": ["pages/p0.png", "pages/missing.jpg"],
                      "bare": ["pages/a", "pages/b"], "note": ["first page", "second page"],
                      "negs": [["one", "two"], ["three"]], "image": [{"bytes": _png(30, 30), "path": None}] * 2})
    pq.write_table(table, tmp_path / "pairs.parquet")
    split = parquet_split(tmp_path / "pairs.parquet", "train")
    for column in ("page", "bare", "image"):
        check_image_column(split, "image", Columns(image=column))
    with pytest.raises(ColumnError) as info:
        check_image_column(split, "image", Columns(image="note"))
    assert info.value.role == "image"
    assert str(info.value) == (
        "the image column 'note' holds text, not images: row 0's value 'first page' is not an image file (no file of "
        "that name, and none of the first 2 values has an image extension such as .png; "
        f"{tmp_path / 'pairs.parquet'} split 'train'; columns: ['query', 'page', 'bare', 'note', 'negs', 'image']); "
        "pass Columns(image=...) naming the right one")
    # the command line names its flag for the same fix
    assert str(info.value.with_fix(column_fix("image", "eval_"))).endswith(
        "pass --eval-image-column (key eval_image_column) naming the right one")
    with pytest.raises(ColumnError, match=r"^the hard-negatives column 'query' holds text, not images: row 0's value "
                                          r"'what is on page 0' is not an image file \(it is the query column; .*"):
        check_image_column(split, "negatives", Columns(negatives="query"))
    with pytest.raises(ColumnError, match=r"^the hard-negatives column 'negs' holds text, not images: row 0's value 'one'"):
        check_image_column(split, "negatives", Columns(negatives="negs"))
    assert column_fix("negatives") == "pass --negatives-column (key negatives_column) naming the right one, or none"
    # the loader (raggedvl eval / encode, hub data) refuses the same columns with the same message
    hf = datasets.Dataset.from_parquet(str(tmp_path / "pairs.parquet"))
    with pytest.raises(ColumnError, match=r"^the image column 'note' holds text, not images: row 0's value"):
        RetrievalDataset.from_hf(hf, columns=Columns(image="note"))
    with pytest.raises(ColumnError, match=r"^the hard-negatives column 'query' holds text.*it is the query column"):
        RetrievalDataset.from_hf(hf, columns=Columns(image="image", negatives="query"))
    assert len(RetrievalDataset.from_hf(hf, columns=Columns(image="page"), base_dir=tmp_path)) == 2


def test_a_missing_column_suggests_a_close_name_or_another_datasets_name_for_it():
    from raggedvl.data.columns import ColumnError, Columns
    from raggedvl.data.scan import check_columns

    def hint(available, **columns):
        with pytest.raises(ColumnError) as info:
            check_columns(available, "t", Columns(**columns))
        return str(info.value)

    assert "has no column 'qeury' (columns: ['query', 'image']); did you mean 'query'?" in hint(["query", "image"],
                                                                                                query="qeury")
    assert "has no column 'image' (columns: ['question', 'page']); did you mean 'page'?" in hint(["question", "page"],
                                                                                                 query="question")
    assert "did you mean 'question'?" in hint(["question", "page"])  # the query column under another dataset's name
    assert "did you mean" not in hint(["question", "page"], query="question", image="page", id="uuid")  # none close

"""Which pairs a run trains and evaluates on: datasets' split inference, held-out fractions, and
train/evaluation overlap by content (refused unless allowed)."""

import pytest

from raggedvl.data import load_retrieval_dataset
from raggedvl.data.columns import Columns
from raggedvl.data.splits import hash_split
from raggedvl.app.config import TrainConfig
from raggedvl.app.setup import load_splits

from ..evaluation.test_benchmark import png, write_pairs


def pairs(prefix, n, offset=0):
    return [(f"{prefix} query {i}", png(offset + i, (30 + i, 20))) for i in range(n)]


def cfg(dataset, **kw):
    return TrainConfig(dataset=str(dataset), max_train_samples=None, max_eval_samples=None, **kw)


def test_two_file_folder_evaluates_on_the_dev_file_only(tmp_path):
    write_pairs(tmp_path / "train.parquet", pairs("train", 24))
    write_pairs(tmp_path / "dev.parquet", pairs("dev", 12, offset=100))
    train, bench = load_splits(cfg(tmp_path))
    assert len(train) == 24 and all(q.startswith("train") for q in train.queries())
    assert len(bench.queries) == 12 and all(q.startswith("dev") for q in bench.queries)
    assert len(bench.documents) == 12


def test_hub_layout_folder_splits_are_respected(tmp_path):
    (tmp_path / "data").mkdir()
    write_pairs(tmp_path / "data" / "train-00000-of-00001.parquet", pairs("train", 10))
    write_pairs(tmp_path / "data" / "test-00000-of-00001.parquet", pairs("test", 5, offset=50))
    train, bench = load_splits(cfg(tmp_path, eval_split="test"))
    assert {q.split()[0] for q in train.queries()} == {"train"} and {q.split()[0] for q in bench.queries} == {"test"}
    with pytest.raises(ValueError, match=r"no split 'dev'.*\['test', 'train'\].*raggedvl eval / encode: pass --split.*--eval-dataset"):
        load_splits(cfg(tmp_path))


def test_one_file_is_a_training_set_only(tmp_path):
    path = write_pairs(tmp_path / "pairs.parquet", pairs("p", 40))
    with pytest.raises(ValueError, match="--eval-fraction"):
        load_splits(cfg(path))
    train, bench = load_splits(cfg(path, eval_fraction=0.25))
    assert len(train) + len(bench.documents) == 40 and 0 < len(bench.documents) < 40
    assert not set(bench.queries) & set(train.queries())
    # no evaluation asked for: nothing to split
    assert load_splits(cfg(path, eval_before=False, eval_after=False))[1] is None


def test_a_file_named_by_its_split_is_that_split(tmp_path):
    """``dev.parquet`` given alone is the dev split (its name, by datasets' keywords), as it is
    inside a folder; a name without a split keyword stays a training set only."""
    dev = write_pairs(tmp_path / "my-dev-pairs.parquet", pairs("dev", 6))
    test = write_pairs(tmp_path / "test_00.parquet", pairs("test", 5, offset=50))
    assert load_retrieval_dataset(dev, "dev").queries() == [f"dev query {i}" for i in range(6)]
    assert len(load_retrieval_dataset(dev, "validation")) == 6
    assert len(load_retrieval_dataset(test, "test")) == 5
    with pytest.raises(ValueError, match=r"no split 'train'; its splits: \['validation'\]"):
        load_retrieval_dataset(dev, "train")
    train = write_pairs(tmp_path / "pairs.parquet", pairs("p", 8, offset=80))
    _, bench = load_splits(cfg(train, eval_dataset=str(dev), eval_split="dev"))
    assert len(bench.queries) == 6 and all(q.startswith("dev") for q in bench.queries)


def test_hash_split_keeps_copies_of_one_image_together(tmp_path):
    rows = pairs("p", 30) + [(f"copy {i}", png(i, (30 + i, 20))) for i in range(30)]
    ds = load_retrieval_dataset(write_pairs(tmp_path / "x.parquet", rows), "train")
    rest, held = hash_split(ds, 0.3)
    assert not set(rest.image_digests()) & set(held.image_digests())


def test_overlap_is_refused_unless_allowed(tmp_path, capsys):
    write_pairs(tmp_path / "train.parquet", pairs("train", 8))
    other = tmp_path / "other"
    other.mkdir()
    shared = pairs("train", 8)[2:4]  # same image bytes and same query text as two training pairs
    write_pairs(other / "test.parquet", shared + pairs("fresh", 4, offset=200))
    with pytest.raises(ValueError, match=r"2 of 6 evaluation documents .* 2 of 6 evaluation queries.*--allow-eval-overlap"):
        load_splits(cfg(tmp_path, eval_dataset=str(other), eval_split="test"))
    load_splits(cfg(tmp_path, eval_dataset=str(other), eval_split="test", allow_eval_overlap=True))
    assert "overlaps the training pairs" in capsys.readouterr().err


def test_config_rejects_conflicting_eval_options():
    with pytest.raises(ValueError, match="eval_fraction"):
        TrainConfig(eval_fraction=1.0)
    with pytest.raises(ValueError, match="cannot be combined"):
        TrainConfig(eval_fraction=0.1, eval_dataset="x")
    with pytest.raises(ValueError, match="save_best"):
        TrainConfig(save_best="ndcg@7")


def test_an_eval_dataset_of_one_split_is_evaluated_on_it_whatever_its_name(tmp_path):
    """A single file (``heldout.parquet``: split "train" by its name) or a folder of one split
    file given as eval_dataset is the evaluation set; a folder of several splits keeps the
    dev*/test* rules."""
    train = write_pairs(tmp_path / "pairs.parquet", pairs("train", 8))
    heldout = write_pairs(tmp_path / "heldout.parquet", pairs("held", 5, offset=100))
    _, bench = load_splits(cfg(train, eval_dataset=str(heldout)))
    assert bench.queries == [f"held query {i}" for i in range(5)]
    folder = tmp_path / "one"
    folder.mkdir()
    write_pairs(folder / "train.parquet", pairs("folder", 4, offset=200))
    _, bench = load_splits(cfg(train, eval_dataset=str(folder)))
    assert sorted(bench.queries) == [f"folder query {i}" for i in range(4)]
    write_pairs(folder / "test.parquet", pairs("test", 3, offset=300))
    with pytest.raises(ValueError, match=r"no split 'dev'; its splits: \['test', 'train'\]"):
        load_splits(cfg(train, eval_dataset=str(folder)))
    _, bench = load_splits(cfg(train, eval_dataset=str(folder), eval_split="test"))
    assert sorted(bench.queries) == [f"test query {i}" for i in range(3)]


def test_a_hard_negative_that_is_an_evaluation_page_is_overlap(tmp_path, capsys):
    """Hard negatives are pages the run trains on: an evaluation document with the bytes of one
    is refused like a training positive, and let through with allow_eval_overlap."""
    import datasets

    from raggedvl.data.splits import find_overlap

    dev = pairs("dev", 4, offset=100)
    rows = pairs("train", 6)
    negatives = [[{"bytes": dev[1][1], "path": None}] if i == 2 else [] for i in range(6)]
    features = datasets.Features({"query": datasets.Value("string"), "image": datasets.Image(),
                                  "negs": datasets.List(datasets.Image())})
    datasets.Dataset.from_dict({"query": [q for q, _ in rows], "image": [{"bytes": b, "path": None} for _, b in rows],
                                "negs": negatives}, features=features).to_parquet(str(tmp_path / "train.parquet"))
    heldout = write_pairs(tmp_path / "heldout.parquet", dev)
    train = load_retrieval_dataset(tmp_path / "train.parquet", "train")
    bench = load_splits(cfg(tmp_path / "train.parquet", eval_dataset=str(heldout), allow_eval_overlap=True))[1]
    assert not find_overlap(train, bench.documents, bench.queries)  # without its hard negatives: no overlap
    with pytest.raises(ValueError, match=r"overlaps the training pairs: 1 of 4 evaluation documents have the same "
                                         r"image bytes as a training page \(a positive or hard negative\), and 0 of 4"):
        load_splits(cfg(tmp_path / "train.parquet", eval_dataset=str(heldout), negatives_column="negs"))
    load_splits(cfg(tmp_path / "train.parquet", eval_dataset=str(heldout), negatives_column="negs",
                    allow_eval_overlap=True))
    assert "1 of 4 evaluation documents" in capsys.readouterr().err


def test_hash_split_leaves_held_out_pages_out_of_the_training_hard_negatives(tmp_path):
    """Mined negatives are other rows' pages: a held-out page is dropped from the training rows'
    hard negatives (the others kept, in order), so --eval-fraction on mined pairs has no overlap."""
    import datasets

    from raggedvl.data.splits import find_overlap

    rows = pairs("p", 30)
    negatives = [[{"bytes": rows[(i + d) % 30][1], "path": None} for d in (1, 2)] for i in range(30)]
    features = datasets.Features({"query": datasets.Value("string"), "image": datasets.Image(),
                                  "negs": datasets.List(datasets.Image())})
    datasets.Dataset.from_dict({"query": [q for q, _ in rows], "image": [{"bytes": b, "path": None} for _, b in rows],
                                "negs": negatives}, features=features).to_parquet(str(tmp_path / "train.parquet"))
    ds = load_retrieval_dataset(tmp_path / "train.parquet", "train", columns=Columns(negatives="negs"))
    rest, held = hash_split(ds, 0.3)
    held_rows = {int(q.split()[-1]) for q in held.queries()}
    assert 0 < len(held_rows) < 30
    for r, query in enumerate(rest.queries()):
        i = int(query.split()[-1])
        expected = [rows[(i + d) % 30][1] for d in (1, 2) if (i + d) % 30 not in held_rows]
        assert [n["bytes"] for n in rest.negative_sources[r]] == expected
        assert rest.negative_counts[r] == len(expected)
    assert not find_overlap(rest, held, held.queries())
    assert find_overlap(ds.select([i for i in range(30) if i not in held_rows]), held, [])  # before: overlap

"""Several positives per query: an image column of lists. An item holds one positive decoded and
the keys of the others; the draw per epoch is seeded and stable; the collator hands the further
keys to the losses; the size estimate counts the first or the largest positive; an empty list is
a one-line error naming the row."""

from __future__ import annotations

import io

import datasets
import pytest
import torch
from PIL import Image

from raggedvl.data.columns import Columns
from raggedvl.data import RetrievalCollator, load_retrieval_dataset
from raggedvl.data.concat import concat_datasets
from raggedvl.data.keys import bytes_key
from raggedvl.data.positives import EpochPositives, drawn_positive
from raggedvl.images import ImagePolicy
from raggedvl.sampling import estimate_costs


def png(seed: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (56 + 28 * (seed % 4), 56 + 14 * (seed % 3)), (10 * seed % 255, 80, 160)).save(buffer, format="PNG")
    return buffer.getvalue()


def positives_parquet(path, lists, negatives=None) -> str:
    """One row per entry of ``lists`` (the seeds of its positives); ``negatives`` likewise."""
    data = {"query": [f"question {i}" for i in range(len(lists))],
            "image": [[{"bytes": png(s), "path": None} for s in row] for row in lists]}
    features = {"query": datasets.Value("string"), "image": datasets.List(datasets.Image())}
    if negatives is not None:
        data["negs"] = [[{"bytes": png(s), "path": None} for s in row] for row in negatives]
        features["negs"] = datasets.List(datasets.Image())
    datasets.Dataset.from_dict(data, features=datasets.Features(features)).to_parquet(str(path))
    return str(path)


def test_an_item_holds_one_positive_and_the_keys_of_the_others(tmp_path):
    ds = load_retrieval_dataset(positives_parquet(tmp_path / "p.parquet", [[1, 2], [3, 4, 5], [6]]))
    assert list(ds.positive_counts) == [2, 3, 1]
    first = ds[1]  # positive 0
    assert first["image"].size == Image.open(io.BytesIO(png(3))).size
    assert first["doc_key"] == bytes_key(png(3)) and first["relevant_keys"] == [bytes_key(png(4)), bytes_key(png(5))]
    second = ds.item(1, positive=2)
    assert second["image"].size == Image.open(io.BytesIO(png(5))).size
    assert second["doc_key"] == bytes_key(png(5)) and second["relevant_keys"] == [bytes_key(png(3)), bytes_key(png(4))]
    assert ds[2]["relevant_keys"] == []
    with pytest.raises(IndexError, match="has 1 positives, not 2"):
        ds.item(2, positive=1)
    picked = ds.select([1])  # a selection keeps each row's positives
    assert picked[0]["relevant_keys"] == first["relevant_keys"]
    both = concat_datasets([ds, load_retrieval_dataset(tmp_path / "p.parquet")], ["a", "b"])
    assert list(both.positive_counts) == [2, 3, 1, 2, 3, 1] and both.item(4, positive=1)["doc_key"] == bytes_key(png(4))


def test_the_draw_is_seeded_stable_and_reaches_every_positive():
    assert {drawn_positive(3, "first", seed=s, epoch=e, row=r) for s in range(3) for e in range(5) for r in range(9)} == {0}
    draws = [[drawn_positive(3, "random", seed=7, epoch=e, row=r) for e in range(12)] for r in range(6)]
    assert draws == [[drawn_positive(3, "random", seed=7, epoch=e, row=r) for e in range(12)] for r in range(6)]
    assert {d for row in draws for d in row} == {0, 1, 2}
    assert any(len(set(row)) > 1 for row in draws)  # a row changes positive between epochs
    assert draws != [[drawn_positive(3, "random", seed=8, epoch=e, row=r) for e in range(12)] for r in range(6)]
    with pytest.raises(ValueError, match="positive sampling must be one of"):
        drawn_positive(2, "last", seed=0, epoch=0, row=0)


def test_epoch_items_follow_the_draw(tmp_path):
    ds = load_retrieval_dataset(positives_parquet(tmp_path / "p.parquet", [[1, 2], [3, 4, 5]]))
    rows = EpochPositives(ds, "random", seed=3)
    for epoch in range(4):
        for row in range(2):
            j = drawn_positive(ds.positive_counts[row], "random", seed=3, epoch=epoch, row=row)
            assert rows[(row, epoch)]["doc_key"] == ds.item(row, positive=j)["doc_key"]


def test_the_collator_hands_the_further_positives_to_the_losses(tmp_path, tiny_processor):
    ds = load_retrieval_dataset(positives_parquet(tmp_path / "p.parquet", [[1, 2], [6], [3, 4, 5]], [[7], [], [8, 9]]),
                                columns=Columns(negatives="negs"))
    batch = RetrievalCollator(tiny_processor)([ds[2], ds[1], ds.item(0, positive=1)])
    assert batch["relevant_counts"].tolist() == [2, 0, 1]
    assert batch["relevant_keys"].tolist() == [bytes_key(png(4)), bytes_key(png(5)), bytes_key(png(1))]
    assert batch["doc_keys"].tolist() == [bytes_key(png(3)), bytes_key(png(6)), bytes_key(png(2))]
    assert batch["neg_counts"].tolist() == [2, 0, 1] and batch["negatives"].num_samples == 3


def test_the_estimate_counts_the_first_or_the_largest_positive(tmp_path, tiny_processor):
    ds = load_retrieval_dataset(positives_parquet(tmp_path / "p.parquet", [[0, 3], [2, 1]]))
    policy = ImagePolicy.from_processor(tiny_processor)

    def patches(seed):
        return int(torch.tensor(policy.inspect(png(seed)).grid).prod())

    assert estimate_costs(ds.image_inputs(), 32, policy=policy).patches.tolist() == [patches(0), patches(2)]
    largest = estimate_costs(ds.image_inputs(lambda row: max(row, key=lambda p: int(torch.tensor(policy.inspect(p).grid).prod()))),
                             32, policy=policy)
    assert largest.patches.tolist() == [max(patches(0), patches(3)), max(patches(2), patches(1))]
    assert largest.patches.tolist() != [patches(0), patches(2)]  # the data does tell them apart


def test_an_empty_list_of_positives_names_the_row(tmp_path):
    with pytest.raises(ValueError, match=r"row 1 \(id 'train-1'\) has no image in its list of positives in column 'image'"):
        load_retrieval_dataset(positives_parquet(tmp_path / "p.parquet", [[1], []]))

"""Hard negatives from a column of images: the dataset reads them lazily, the size estimate
counts their patches, the collator encodes them exactly as documents, rows hold any number of
them (none included), and bad columns or rows are one-line errors naming the row and the fix."""

from __future__ import annotations

import io

import datasets
import pytest
import torch
from PIL import Image

from raggedvl.data.columns import Columns
from raggedvl.data import RetrievalCollator, load_retrieval_dataset
from raggedvl.data.concat import concat_datasets
from raggedvl.images import BadImageError, ImagePolicy
from raggedvl.sampling import estimate_costs


def png(seed: int, width: int | None = None) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width or 56 + 8 * seed, 56 + 4 * (seed % 5)), (10 * seed % 255, 80, 160)).save(buffer, format="PNG")
    return buffer.getvalue()


def image(seed: int) -> dict:
    return {"bytes": png(seed), "path": None}


def negatives_parquet(path, n=6, k=2, *, single=False, rows=None, feature=None):
    """(query, image, negs) rows; ``negs`` holds k images per row (one image when ``single``);
    ``rows`` overrides chosen rows' negatives cell."""
    negs = [image(100 + i) if single else [image(100 + 10 * i + j) for j in range(k)] for i in range(n)]
    for row, value in (rows or {}).items():
        negs[row] = value
    if feature is None:
        feature = datasets.Image() if single else datasets.List(datasets.Image())
    data = {"query": [f"question {i}" for i in range(n)], "image": [image(i) for i in range(n)], "negs": negs}
    features = datasets.Features({"query": datasets.Value("string"), "image": datasets.Image(), "negs": feature})
    datasets.Dataset.from_dict(data, features=features).to_parquet(str(path))
    return str(path)


def test_items_hold_k_decoded_negatives_and_the_estimate_counts_their_patches(tmp_path, tiny_processor):
    lists = load_retrieval_dataset(negatives_parquet(tmp_path / "k2.parquet"), columns=Columns(negatives="negs"))
    single = load_retrieval_dataset(negatives_parquet(tmp_path / "k1.parquet", single=True), columns=Columns(negatives="negs"))
    assert (list(lists.negative_counts), list(single.negative_counts)) == ([2] * 6, [1] * 6)
    item = lists[3]
    assert [im.size for im in item["negatives"]] == [Image.open(io.BytesIO(png(130 + j))).size for j in range(2)]
    assert [im.size for im in single[3]["negatives"]] == [Image.open(io.BytesIO(png(103))).size]
    policy = ImagePolicy.from_processor(tiny_processor)
    with_negs = estimate_costs(lists.image_inputs(), text_tokens=32, policy=policy)
    plain = load_retrieval_dataset(tmp_path / "k2.parquet")  # same rows, no negatives column
    alone = estimate_costs(plain.image_inputs(), text_tokens=32, policy=policy)
    neg_patches = [sum(int(torch.tensor(policy.inspect(png(100 + 10 * i + j)).grid).prod()) for j in range(2))
                   for i in range(6)]
    assert with_negs.patches.tolist() == [a + b for a, b in zip(alone.patches.tolist(), neg_patches)]
    assert (with_negs.costs > alone.costs).all()
    picked = lists.select([4, 1])  # selection keeps each row's negatives
    assert list(picked.negative_counts) == [2, 2]
    assert [im.size for im in picked[0]["negatives"]] == [im.size for im in lists[4]["negatives"]]


def test_the_collator_encodes_negatives_exactly_as_documents(tmp_path, tiny_processor):
    ds = load_retrieval_dataset(negatives_parquet(tmp_path / "k2.parquet", n=3), columns=Columns(negatives="negs"))
    collate = RetrievalCollator(tiny_processor)
    batch = collate([ds[i] for i in range(3)])
    negs = batch["negatives"]
    assert batch["docs"].num_samples == 3 and negs.num_samples == 6  # B*k, query-major
    as_docs = collate.collate_documents([{"id": f"n{j}", "image": im} for i in range(3) for j, im in
                                         enumerate(ds[i]["negatives"])])["docs"]
    assert torch.equal(negs["pixel_values"], as_docs["pixel_values"])
    assert torch.equal(negs["image_grid_thw"], as_docs["image_grid_thw"])
    for row in range(6):  # the same tokens, only the padding to the batch's length differs
        got = negs["input_ids"][row][negs["attention_mask"][row].bool()]
        want = as_docs["input_ids"][row][as_docs["attention_mask"][row].bool()]
        assert torch.equal(got, want)
    # the positives are unchanged by the negatives sharing their processor call
    plain = collate([{k: v for k, v in ds[i].items() if k != "negatives"} for i in range(3)])
    assert torch.equal(batch["docs"]["pixel_values"], plain["docs"]["pixel_values"])
    assert "negatives" not in plain


def test_a_bad_negative_drops_its_row_under_skip_and_names_it_under_error(tmp_path, tiny_processor):
    cut = {"bytes": b"\x89PNG\r\n\x1a\n cut", "path": None}
    path = negatives_parquet(tmp_path / "bad.parquet", n=4, rows={2: [image(7), cut]})
    strict = load_retrieval_dataset(path, columns=Columns(negatives="negs"))
    with pytest.raises(BadImageError, match=r"row 2 .*hard negative 1"):
        strict[2]
    with pytest.raises(BadImageError, match=r"row 2 .*image 2"):  # the startup header scan finds it too
        estimate_costs(strict.image_inputs(), 32, names=[strict.row_name(i) for i in range(4)])
    lenient = load_retrieval_dataset(path, columns=Columns(negatives="negs"), on_bad_image="skip")
    batch = RetrievalCollator(tiny_processor, on_bad_image="skip")([lenient[i] for i in range(4)])
    assert batch["ids"] == ["train-0", "train-1", "train-3"] and batch["negatives"].num_samples == 6
    assert [s["id"] for s in batch["skipped"]] == ["train-2"]


def test_rows_hold_any_number_of_negatives_and_the_estimate_counts_each_rows_own(tmp_path, tiny_processor):
    """Rows with 0 (empty list, null), 1 and 3 negatives: nothing is padded; each row's patch
    count is its document's plus its own negatives'; the collator says which negatives belong
    to which query (neg_counts) and encodes them in order."""
    rows = {0: [], 1: None, 2: [image(7)], 3: [image(8), image(9), image(11)]}
    ds = load_retrieval_dataset(negatives_parquet(tmp_path / "ragged.parquet", n=5, rows=rows), columns=Columns(negatives="negs"))
    assert list(ds.negative_counts) == [0, 0, 1, 3, 2]
    assert [len(ds[i]["negatives"]) for i in range(5)] == [0, 0, 1, 3, 2]
    policy = ImagePolicy.from_processor(tiny_processor)
    costs = estimate_costs(ds.image_inputs(), text_tokens=32, policy=policy)

    def patches(data):
        return int(torch.tensor(policy.inspect(data).grid).prod())

    negatives = {0: [], 1: [], 2: [png(7)], 3: [png(8), png(9), png(11)], 4: [png(140), png(141)]}
    assert costs.patches.tolist() == [patches(png(i)) + sum(map(patches, negatives[i])) for i in range(5)]
    batch = RetrievalCollator(tiny_processor)([ds[i] for i in (3, 0, 2)])
    assert batch["neg_counts"].tolist() == [3, 0, 1] and batch["negatives"].num_samples == 4
    assert batch["neg_keys"].tolist() == ds[3]["negative_keys"] + ds[2]["negative_keys"]
    none = RetrievalCollator(tiny_processor)([ds[0], ds[1]])  # no negative in this batch: none encoded
    assert none["neg_counts"].tolist() == [0, 0] and "negatives" not in none


def test_a_column_that_is_missing_or_holds_no_images_names_the_fix(tmp_path):
    path = negatives_parquet(tmp_path / "k2.parquet")
    with pytest.raises(ValueError, match=r"no hard-negatives column 'negatives' .*did you mean 'negs'\? "
                                         r"pass Columns\(negatives=...\)"):
        load_retrieval_dataset(path, columns=Columns(negatives="negatives"))
    numbers = tmp_path / "numbers.parquet"
    datasets.Dataset.from_dict({"query": ["a", "b"], "image": [image(1), image(2)], "negs": [[1, 2], [3, 4]]},
                               features=datasets.Features({"query": datasets.Value("string"), "image": datasets.Image(),
                                                           "negs": datasets.List(datasets.Value("int64"))})
                               ).to_parquet(str(numbers))
    with pytest.raises(ValueError, match=r"column 'negs' holds int64 values, not images"):
        load_retrieval_dataset(numbers, columns=Columns(negatives="negs"))
    with pytest.raises(ValueError, match="rdocs manifest, which has no hard-negatives column"):
        load_retrieval_dataset("rdocs", columns=Columns(negatives="negs"))


def test_collator_refuses_negatives_that_are_no_list_or_held_by_some_examples_only(tiny_processor):
    im = Image.open(io.BytesIO(png(1)))
    examples = [{"id": "a", "query": "q a", "image": im, "negatives": [im, im]}, {"id": "b", "query": "q b", "image": im}]
    with pytest.raises(ValueError, match=r"examples \[1\] hold no 'negatives' list while others do"):
        RetrievalCollator(tiny_processor)(examples)
    with pytest.raises(ValueError, match="'negatives' must be a list of images"):
        RetrievalCollator(tiny_processor)([{"id": "a", "query": "q", "image": im, "negatives": im}])


def test_concatenated_datasets_keep_negatives_rows_and_distinct_ids(tmp_path):
    a = load_retrieval_dataset(negatives_parquet(tmp_path / "a.parquet", n=3), columns=Columns(negatives="negs"))
    b = load_retrieval_dataset(negatives_parquet(tmp_path / "b.parquet", n=2), columns=Columns(negatives="negs"))
    both = concat_datasets([a, b], ["a", "b"])
    assert len(both) == 5 and both.part_sizes == [3, 2] and list(both.negative_counts) == [2] * 5
    assert both.ids() == ["0:train-0", "0:train-1", "0:train-2", "1:train-0", "1:train-1"]
    assert both.row_name(4).startswith(f"{b.where} row 1") and len(both[4]["negatives"]) == 2
    assert len(both.image_inputs()[4]) == 3  # the image and its two negatives
    one = load_retrieval_dataset(negatives_parquet(tmp_path / "c.parquet", n=2, single=True), columns=Columns(negatives="negs"))
    mixed = concat_datasets([a, one], ["a", "c"])  # rows keep their own counts
    assert list(mixed.negative_counts) == [2, 2, 2, 1, 1] and len(mixed[4]["negatives"]) == 1
    plain = load_retrieval_dataset(tmp_path / "b.parquet")
    with pytest.raises(ValueError, match="a has a hard-negatives column but p has none"):
        concat_datasets([a, plain], ["a", "p"])


def test_a_benchmark_of_training_pairs_holds_documents_without_negatives(tmp_path):
    from raggedvl.evaluation.benchmark import RetrievalBenchmark

    ds = load_retrieval_dataset(negatives_parquet(tmp_path / "k2.parquet", n=4), columns=Columns(negatives="negs"))
    bench = RetrievalBenchmark.from_pairs(ds)
    assert bench.documents.negative_sources is None and "negatives" not in bench.documents[0]
    assert len(ds.select([1, 2])[1]["negatives"]) == 2  # a plain selection keeps them


def test_the_hf_wire_collator_refuses_negatives_it_would_drop(tiny_processor):
    from raggedvl.hf import RetrievalWireCollator

    im = Image.open(io.BytesIO(png(1)))
    with pytest.raises(ValueError, match="holds 2 hard negatives, which RaggedTrainer does not score"):
        RetrievalWireCollator(RetrievalCollator(tiny_processor))([{"id": "a", "query": "q", "image": im, "negatives": [im]},
                                                                 {"id": "b", "query": "r", "image": im, "negatives": [im]}])

"""Hard-negative mining (``raggedvl.evaluation.mining``, ``raggedvl mine``) on a tiny retriever:
the mined lists equal the brute-force ranking filtered by hand (positives, pages with the same
bytes as a positive, skip-top, the positive-aware ratio), and the command writes both layouts."""

import pyarrow.parquet as pq
import pytest
import torch

from raggedvl.app.cli import main
from raggedvl.data import RetrievalCollator, build_processor
from raggedvl.evaluation.benchmark import load_benchmark
from raggedvl.evaluation.encode import embed_documents, embed_queries
from raggedvl.evaluation.mining import mine_negatives
from raggedvl.evaluation.ranking import tie_keys, top_k
from raggedvl.evaluation.search import pad_rows
from raggedvl.losses import late_interaction_scores
from raggedvl.models import build_retriever

from .test_benchmark import write_beir
from .test_eval_cli import noise_png

SIZES = [(56, 56), (84, 56), (56, 112), (112, 84), (56, 56), (140, 56), (84, 84), (112, 56), (56, 84)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("mining")
    processor = build_processor("tiny")
    model = build_retriever("tiny", processor=processor, seed=0)
    model.save_pretrained(root / "model")
    corpus = [(f"doc-{i}", noise_png(i, s)) for i, s in enumerate(SIZES)]
    corpus.append(("doc-copy", corpus[0][1]))  # the same page as doc-0 under another id
    queries = [("q1", "sample quantiles"), ("q2", "biplot of data"), ("q3", "writing extensions"),
               ("q4", "an introduction"), ("q5", "graphics devices")]
    qrels = [("q1", "doc-0", 1), ("q1", "doc-3", 2), ("q2", "doc-1", 1), ("q3", "doc-6", 1), ("q4", "doc-2", 1),
             ("q5", "doc-8", 1)]
    return root, model, processor, write_beir(root / "beir", corpus, queries, qrels)


def reference(model, bench, *, k, ratio, skip_top):
    """Every document ranked by brute force, then the filters applied one by one."""
    q = embed_queries(model, bench.queries, batch_size=3, progress=False)
    d = embed_documents(model, bench.documents, batch_size=2, progress=False)
    (qe, qm), (de, dm) = pad_rows(q), pad_rows(d)
    scores = late_interaction_scores(qe, qm, de, dm)
    ranked = top_k(scores, len(bench.documents), tie_keys(bench.doc_ids))
    digests = bench.documents.image_digests()
    out = []
    for qi, rels in enumerate(bench.qrels):
        pos = {p for p, g in rels.items() if g >= 1}
        same = {j for j in range(len(digests)) if digests[j] in {digests[p] for p in pos}}
        lowest = min(float(scores[qi, p]) for p in pos)
        rest = [int(j) for j in ranked.indices[qi] if int(j) not in pos | same][skip_top:]
        out.append([j for j in rest if float(scores[qi, j]) < ratio * lowest][:k])
    return out, scores


@pytest.mark.parametrize("k, ratio, skip_top", [(3, 0.95, 0), (2, 1.0, 1), (9, 0.95, 0)])
def test_mined_negatives_equal_the_filtered_brute_force_ranking(setup, k, ratio, skip_top):
    _, model, processor, beir = setup
    bench = load_benchmark(beir, "test")
    collate = RetrievalCollator(processor, prompts=model.config.prompts, layout=model.family.name)
    mined = mine_negatives(model, collate, bench, k=k, max_positive_ratio=ratio, skip_top=skip_top, batch_size=2)
    expected, scores = reference(model, bench, k=k, ratio=ratio, skip_top=skip_top)
    assert mined.negatives == expected
    copy, first = bench.doc_ids.index("doc-copy"), bench.doc_ids.index("doc-0")
    assert all(copy not in row and first not in row for row in mined.negatives[:1])  # q1's page and its copy
    for qi, row in enumerate(mined.negatives):
        assert mined.scores[qi] == pytest.approx([float(scores[qi, j]) for j in row], abs=1e-5)
    assert mined.short == sum(len(row) < k for row in expected)
    assert mined.removed["skip_top"] == skip_top * len(bench.queries)  # every query had candidates to skip
    if k == 9:  # the whole corpus ranked: every candidate of every query is kept or counted by one filter
        removed = sum(mined.removed.values())
        assert removed + sum(len(r) for r in mined.negatives) == len(bench.queries) * len(bench.documents)


def test_mine_command_writes_pairs_with_a_negatives_column_and_beir_by_reference(setup, capsys):
    root, _, _, beir = setup
    import datasets

    pairs = root / "pairs.parquet"
    rows = [("sample quantiles", noise_png(0, SIZES[0])), ("biplot of data", noise_png(1, SIZES[1])),
            ("biplot of data", noise_png(3, SIZES[3])), ("writing extensions", noise_png(6, SIZES[6])),
            ("an introduction", noise_png(2, SIZES[2])), ("graphics devices", noise_png(8, SIZES[8]))]
    datasets.Dataset.from_dict({"query": [q for q, _ in rows], "image": [{"bytes": b, "path": None} for _, b in rows]},
                               features=datasets.Features({"query": datasets.Value("string"), "image": datasets.Image()})
                               ).to_parquet(str(pairs))
    assert main(["mine", str(root / "model"), "--dataset", str(pairs), "--output", str(root / "mined"), "-k", "2",
                 "--batch-size", "2"]) == 0
    printed = capsys.readouterr().out
    assert "raggedvl train --dataset" in printed and "--negatives-column negatives" in printed
    table = pq.read_table(root / "mined" / "train.parquet")
    assert table.column_names == ["query", "image", "negatives"] and table.num_rows == len(rows)
    own = {q: {r[1] for r in rows if r[0] == q} for q, _ in rows}
    for query, negatives in zip(table.column("query").to_pylist(), table.column("negatives").to_pylist()):
        assert len(negatives) <= 2 and not set(negatives) & own[query]  # never one of the query's own pages

    assert main(["mine", str(root / "model"), "--dataset", str(beir), "--split", "test", "--output", str(root / "by-ref"),
                 "-k", "2", "--batch-size", "2"]) == 0
    negatives = pq.read_table(root / "by-ref" / "negatives.parquet").to_pylist()
    assert [r["query-id"] for r in negatives] == ["q1", "q2", "q3", "q4", "q5"]
    assert all("doc-0" not in r["corpus-ids"] and "doc-copy" not in r["corpus-ids"] for r in negatives[:1])
    assert {p.name for p in (root / "by-ref").iterdir()} == {"corpus.parquet", "queries.parquet", "qrels.parquet",
                                                             "negatives.parquet"}


def test_mine_refuses_a_used_output_and_a_hub_source(setup, tmp_path, capsys):
    root, _, _, beir = setup
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "x").write_text("x")
    assert main(["mine", str(root / "model"), "--dataset", str(beir), "--output", str(tmp_path / "used")]) == 2
    assert f"--output {str(tmp_path / 'used')!r} is not empty (it holds x); mine into a new folder" in capsys.readouterr().err
    assert main(["mine", str(root / "model"), "--dataset", str(beir), "--output", str(tmp_path / "o"),
                 "--max-positive-ratio", "1.5"]) == 2
    assert "--max-positive-ratio must be in (0, 1]" in capsys.readouterr().err


def test_mining_arguments_are_checked(setup):
    _, model, processor, beir = setup
    bench = load_benchmark(beir, "test")
    collate = RetrievalCollator(processor, prompts=model.config.prompts, layout=model.family.name)
    with pytest.raises(ValueError, match="k must be >= 1"):
        mine_negatives(model, collate, bench, k=0)
    assert torch.is_grad_enabled()


def test_mined_pairs_train_with_their_negatives_column(setup, tmp_path, small_data_cache):
    """mine, then train on what it wrote: each step's hard negatives are the mined ones."""
    import json

    import datasets

    from raggedvl.app.config import TrainConfig
    from raggedvl.app.loop import train

    root, _, _, _ = setup
    rows = [(f"question {i}", noise_png(20 + i, SIZES[i % len(SIZES)])) for i in range(8)]
    pairs = tmp_path / "pairs.parquet"
    datasets.Dataset.from_dict({"query": [q for q, _ in rows], "image": [{"bytes": b, "path": None} for _, b in rows]},
                               features=datasets.Features({"query": datasets.Value("string"), "image": datasets.Image()})
                               ).to_parquet(str(pairs))
    assert main(["mine", str(root / "model"), "--dataset", str(pairs), "--output", str(tmp_path / "mined"), "-k", "2",
                 "--batch-size", "4"]) == 0
    mined = pq.read_table(tmp_path / "mined" / "train.parquet").column("negatives").to_pylist()
    train(TrainConfig(dataset=str(tmp_path / "mined" / "train.parquet"), negatives_column="negatives", max_steps=2,
                      global_batch_size=8, warmup_steps=1, eval_before=False, eval_after=False,
                      output_dir=str(tmp_path / "run"), data_cache=str(small_data_cache)))
    steps = [r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
             if r.get("event") == "train"]
    assert [r["hard_negatives"] for r in steps] == [sum(map(len, mined))] * 2  # every row's mined pages, each step


def test_mined_pairs_read_their_relative_image_paths_from_the_output_folder(setup, tmp_path, monkeypatch, capsys):
    """Pairs whose image column holds paths relative to the parquet's folder: the mined rows read
    the same files from the output folder (written as absolute paths, not copied as bytes)."""
    import pyarrow as pa

    from raggedvl.data import load_retrieval_dataset
    from raggedvl.data.columns import Columns

    root, _, _, _ = setup
    data = tmp_path / "d"
    (data / "imgs").mkdir(parents=True)
    paths = []
    for i in range(5):
        (data / "imgs" / f"p{i}.png").write_bytes(noise_png(40 + i, SIZES[i]))
        paths.append(f"imgs/p{i}.png")
    pq.write_table(pa.table({"query": [f"question {i}" for i in range(5)], "image": paths}), data / "pairs.parquet")
    monkeypatch.chdir(tmp_path)  # a relative --output, as a user types it
    assert main(["mine", str(root / "model"), "--dataset", str(data / "pairs.parquet"), "--output", "mined", "-k", "2",
                 "--batch-size", "4"]) == 0, capsys.readouterr().err
    table = pq.read_table(tmp_path / "mined" / "train.parquet")
    assert table.column("image").to_pylist() == [str(data / p) for p in paths]
    counts = [len(n) for n in table.column("negatives").to_pylist()]
    assert sum(counts) > 0
    mined = load_retrieval_dataset("mined", "train", columns=Columns(negatives="negatives"))
    for i in range(len(mined)):  # every positive and negative decodes
        row = mined[i]
        assert row["image"].size == SIZES[i] and len(row["negatives"]) == counts[i]

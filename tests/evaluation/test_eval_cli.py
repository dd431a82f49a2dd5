"""``raggedvl eval CHECKPOINT --dataset BEIR``, ``raggedvl encode`` and ``raggedvl search`` on a
tiny retriever and a BEIR-layout parquet set written here."""

import io
import json
import os

import numpy as np
import pytest
import torch
from PIL import Image

from raggedvl.app.cli import main
from raggedvl.data import build_processor
from raggedvl.evaluation import METRICS, score_metrics, tie_keys, top_k
from raggedvl.evaluation.benchmark import load_benchmark
from raggedvl.evaluation.encode import embed_documents, embed_queries
from raggedvl.evaluation.search import pad_rows
from raggedvl.losses import late_interaction_scores
from raggedvl.models import build_retriever
from raggedvl.app.index_commands import search_index

from .test_benchmark import write_beir


def noise_png(seed: int, size) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 255, (size[1], size[0]), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval-cli")
    processor = build_processor("tiny")
    model = build_retriever("tiny", processor=processor, seed=0)
    model.save_pretrained(root / "model")
    sizes = [(56, 56), (84, 56), (56, 112), (112, 84), (56, 56), (140, 56), (84, 84)]
    corpus = [(f"doc-{i}", noise_png(i, s)) for i, s in enumerate(sizes)]
    queries = [("q1", "sample quantiles"), ("q2", "biplot of data"), ("q3", "writing extensions"), ("q4", "an introduction")]
    qrels = [("q1", "doc-0", 1), ("q1", "doc-3", 2), ("q2", "doc-1", 1), ("q3", "doc-6", 1), ("q4", "doc-2", 3)]
    bench_dir = write_beir(root / "bench", corpus, queries, qrels)
    return root, model, bench_dir


def brute_force_scores(model, bench):
    return late_scores(model, bench.queries, bench.documents)


def late_scores(model, queries, documents):
    """[Q, C] MaxSim scores of the model's own query and document embeddings."""
    q = embed_queries(model, queries, batch_size=3, progress=False)
    d = embed_documents(model, documents, batch_size=2, progress=False)
    (qe, qm), (de, dm) = pad_rows(q), pad_rows(d)
    return late_interaction_scores(qe, qm, de, dm)


def test_eval_dataset_beir_writes_results_json(setup, capsys, monkeypatch):
    root, model, bench_dir = setup
    out = root / "results.json"
    for name in ("HF_DATASETS_DISABLE_PROGRESS_BARS", "HF_HUB_DISABLE_PROGRESS_BARS"):
        monkeypatch.delenv(name, raising=False)  # restored after the test; plain_output sets them
    assert main(["eval", str(root / "model"), "--dataset", str(bench_dir), "--batch-size", "3", "--output", str(out)]) == 0
    results = json.loads(out.read_text())
    bench = load_benchmark(bench_dir)
    want = score_metrics(brute_force_scores(model, bench), bench.qrels, bench.doc_ids)
    assert set(results["metrics"]) == set(METRICS)
    for name in METRICS:
        assert results["metrics"][name] == pytest.approx(want[name], abs=1e-6)
    full = top_k(brute_force_scores(model, bench), len(bench.doc_ids), tie_keys(bench.doc_ids)).indices.tolist()
    first = [1 + next(r for r, d in enumerate(row) if bench.qrels[q].get(d, 0) >= 1) for q, row in enumerate(full)]
    assert results["mean_rank"] == pytest.approx(sum(first) / len(first))
    assert results["random_mean_rank"] == pytest.approx((8 / 3 + 8 / 2 * 3) / 4)  # (n + 1) / (R + 1)
    assert results["dataset"] == str(bench_dir) and results["split"] == "test"
    assert results["counts"]["queries"] == 4 and results["counts"]["documents"] == 7
    assert results["raggedvl_version"] and results["model"]["path"] == str(root / "model")
    printed = capsys.readouterr()
    assert "ndcg@10" in printed.out
    # stderr is not a terminal here: plain progress lines, no carriage return (4 queries and 7
    # documents in batches of 3), and datasets / the hub told to print no bars either
    assert "\r" not in printed.out + printed.err
    progress = [line.split(" (")[0] for line in printed.err.splitlines() if ": batch " in line]
    assert progress == ["queries: batch 1/2", "queries: batch 2/2", "documents: batch 1/3", "documents: batch 2/3",
                        "documents: batch 3/3"]
    assert os.environ["HF_DATASETS_DISABLE_PROGRESS_BARS"] == os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1"


def test_encode_then_search_returns_the_brute_force_top_k(setup, capsys):
    root, model, bench_dir = setup
    index = root / "index"
    assert main(["encode", str(root / "model"), "--dataset", str(bench_dir), "--output", str(index), "--batch-size", "2"]) == 0
    err = capsys.readouterr().err
    assert "\r" not in err and "documents: batch 4/4 (100 %)" in err  # 7 documents in batches of 2, plain lines
    bench = load_benchmark(bench_dir)
    want = top_k(brute_force_scores(model, bench), 5, tie_keys(bench.doc_ids))
    got = search_index(root / "model", index=index, queries=bench.queries, k=5, chunk_size=3)
    for q in range(len(bench.queries)):
        assert [doc for doc, _ in got[q]] == [bench.doc_ids[i] for i in want.indices[q].tolist()]
        assert [s for _, s in got[q]] == pytest.approx(want.scores[q].tolist(), rel=2e-3)  # the index stores float16
    with pytest.raises(ValueError, match=r"is not empty \(it holds index.json, shard-"):
        main_raises(["encode", str(root / "model"), "--dataset", str(bench_dir), "--output", str(index)])


def test_encode_refuses_a_folder_that_holds_other_files_before_loading_the_model(setup, tmp_path, monkeypatch):
    """``encode_corpus`` into a folder holding files that are not an index: refused before the
    model is loaded (or a process group joined), and the folder is left as it was."""
    from raggedvl.app import index_commands

    root, _, bench_dir = setup
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")

    def never(*args, **kwargs):
        raise AssertionError("the model was loaded for a refused --output")

    monkeypatch.setattr(index_commands, "load_model", never)
    monkeypatch.setattr(index_commands, "init_distributed", never)
    with pytest.raises(ValueError) as refused:
        main_raises(["encode", str(root / "model"), "--dataset", str(bench_dir), "--output", str(tmp_path / "out")])
    assert str(refused.value) == (f"--output {str(tmp_path / 'out')!r} is not empty (it holds notes.txt); "
                                  "encode into a new folder")
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["notes.txt"]
    assert (tmp_path / "out" / "notes.txt").read_text() == "mine"


def test_encode_reads_other_column_names_and_the_ids_search_prints(setup, tmp_path):
    """``raggedvl encode --image-column/--id-column``: pairs under other names are encoded (their
    query column is not read), and the index holds the id column's values (search prints them)."""
    import datasets

    from raggedvl.evaluation.index import EmbeddingIndex

    root, _, _ = setup
    rows = {"question": [f"question {i}" for i in range(4)], "page": [{"bytes": noise_png(i, (56, 84)), "path": None}
                                                                     for i in range(4)],
            "doc_id": [f"page-{i}" for i in range(4)]}
    features = datasets.Features({"question": datasets.Value("string"), "page": datasets.Image(),
                                  "doc_id": datasets.Value("string")})
    datasets.Dataset.from_dict(rows, features=features).to_parquet(str(tmp_path / "test.parquet"))
    index = tmp_path / "index"
    assert main(["encode", str(root / "model"), "--dataset", str(tmp_path / "test.parquet"), "--output", str(index),
                 "--image-column", "page", "--id-column", "doc_id"]) == 0
    assert sorted(EmbeddingIndex(index).ids) == [f"page-{i}" for i in range(4)]
    got = search_index(root / "model", index=index, queries=["question 1"], k=4)
    assert sorted(doc for doc, _ in got[0]) == [f"page-{i}" for i in range(4)]


def test_encode_reads_a_plain_folder_of_page_images(setup, tmp_path, capsys):
    """``raggedvl encode CHECKPOINT --dataset FOLDER``: a folder of images (no query column, no
    split in its file names) is the documents of its one split, "train"; a byte-identical copy
    is one document, the index holds the model's own document embeddings, and each document's
    id (what ``search`` prints) is its file's path relative to the folder."""
    from raggedvl.evaluation.index import EmbeddingIndex

    root, model, _ = setup
    pages = tmp_path / "pages"
    (pages / "scans").mkdir(parents=True)
    names = ["p0.png", "scans/p1.png", "scans/p2.png"]
    for i, (name, size) in enumerate(zip(names, [(56, 84), (84, 56), (112, 56)])):
        (pages / name).write_bytes(noise_png(10 + i, size))
    (pages / "p0-copy.png").write_bytes((pages / "p0.png").read_bytes())
    index = tmp_path / "index"
    assert main(["encode", str(root / "model"), "--dataset", str(pages), "--output", str(index)]) == 0
    assert "3 documents (0 skipped)" in capsys.readouterr().out
    built = EmbeddingIndex(index)
    # the folder's rows in path order: p0-copy, p0, scans/p1, scans/p2; the copy's first row stands for both
    assert built.meta["split"] == "train" and built.ids == ["p0-copy.png", "scans/p1.png", "scans/p2.png"]
    assert json.loads((index / "index.json").read_text())["shards"][0]["ids"] == built.ids
    (_, emb, mask), = built.chunks()
    want_emb, want_mask = embed_documents(model, [pages / n for n in names], padded=True, progress=False)
    assert torch.equal(mask, want_mask)
    torch.testing.assert_close(emb, want_emb, rtol=2e-3, atol=2e-3)  # the index stores float16: ~1e-3 relative
    want = top_k(late_scores(model, ["a page of noise"], [pages / n for n in names]), 3, tie_keys(built.ids))
    assert main(["search", str(root / "model"), "--index", str(index), "--query", "a page of noise", "--k", "3"]) == 0
    printed = [line.split()[-1] for line in capsys.readouterr().out.splitlines() if not line.startswith("query:")]
    assert printed == [built.ids[i] for i in want.indices[0].tolist()]


def test_encode_skips_a_batch_whose_every_image_is_unreadable(setup, tmp_path, capsys):
    """``--on-bad-image skip``: the unreadable files sort together (unknown sizes last), so a whole
    batch can be skipped; the index still holds every readable page, with the embeddings of an
    index of the readable pages alone."""
    from raggedvl.evaluation.index import EmbeddingIndex

    root, _, _ = setup
    pages = tmp_path / "pages"
    pages.mkdir()
    for i, size in enumerate([(56, 84), (84, 56), (112, 56)]):
        (pages / f"p{i}.png").write_bytes(noise_png(20 + i, size))
    good = tmp_path / "good"
    good.mkdir()
    for path in sorted(pages.iterdir()):
        (good / path.name).write_bytes(path.read_bytes())
    (pages / "zz-text.png").write_text("not an image")
    (pages / "zz-truncated.png").write_bytes(noise_png(30, (56, 56))[:60])
    index, clean = tmp_path / "index", tmp_path / "clean"
    assert main(["encode", str(root / "model"), "--dataset", str(pages), "--output", str(index), "--batch-size", "2",
                 "--on-bad-image", "skip"]) == 0
    assert "3 documents (2 skipped)" in capsys.readouterr().out
    assert main(["encode", str(root / "model"), "--dataset", str(good), "--output", str(clean), "--batch-size", "2"]) == 0
    built, want = EmbeddingIndex(index), EmbeddingIndex(clean)
    assert built.ids == want.ids == ["p0.png", "p1.png", "p2.png"]
    (_, emb, mask), = built.chunks()
    (_, want_emb, want_mask), = want.chunks()
    assert torch.equal(mask, want_mask) and torch.equal(emb, want_emb)  # the same batches of readable pages


def main_raises(argv):
    from raggedvl.app.index_commands import encode_corpus

    encode_corpus(argv[1], dataset=argv[3], split="test", output=argv[5])


def test_retriever_encode_forms(setup):
    _, model, _ = setup
    ragged = embed_queries(model, ["a b", "a much longer query text", "c"], batch_size=2, progress=False)
    emb, mask = embed_queries(model, ["a b", "a much longer query text", "c"], batch_size=1, progress=False, padded=True)
    assert [r.shape[0] for r in ragged] == mask.sum(1).tolist()
    for i, r in enumerate(ragged):  # same vectors whatever the batching (bucketed, then restored to input order)
        assert torch.allclose(emb[i][mask[i]], r, atol=1e-5)


def test_eval_flags_collapsed_documents_with_the_run_summary_criterion(setup, tmp_path, capsys):
    from raggedvl.app.collapse import doc_cosine_warning

    root, _, bench_dir = setup
    collapsed = build_retriever(str(root / "model"))
    with torch.no_grad():  # every token of every page projects to one vector: the documents collapse
        collapsed.head.proj.weight.zero_()
        collapsed.head.proj.bias.fill_(0.1)
    collapsed.save_pretrained(tmp_path / "collapsed")
    capsys.readouterr()
    for name, want in (("collapsed", True), ("model", None)):
        folder = tmp_path / "collapsed" if name == "collapsed" else root / "model"
        out = tmp_path / f"{name}.json"
        assert main(["eval", str(folder), "--dataset", str(bench_dir), "--output", str(out)]) == 0
        results = json.loads(out.read_text())
        printed = capsys.readouterr().out
        warning = doc_cosine_warning(results["doc_mean_cosine"])
        assert results["collapsed"] == (warning is not None)
        assert (warning in printed) if warning else "WARNING" not in printed
        if want:
            assert results["doc_mean_cosine"] > 0.9999 and results["collapsed"]


def test_eval_reads_pairs_under_other_column_names(setup, tmp_path):
    """``raggedvl eval --query-column/--image-column/--id-column``: the same pairs under other
    column names score exactly as under the default names."""
    import datasets

    root, _, _ = setup
    rows = {"query": [f"page about topic {i}" for i in range(5)],
            "image": [{"bytes": noise_png(40 + i, (56 + 28 * (i % 3), 56)), "path": None} for i in range(5)],
            "doc_id": [f"page-{i}" for i in range(5)]}
    results = {}
    for names in (("query", "image", "doc_id"), ("question", "page", "pid")):
        renamed = datasets.Dataset.from_dict(dict(zip(names, rows.values())),
                                             features=datasets.Features({names[0]: datasets.Value("string"),
                                                                         names[1]: datasets.Image(),
                                                                         names[2]: datasets.Value("string")}))
        path = tmp_path / names[0] / "test.parquet"
        path.parent.mkdir()
        renamed.to_parquet(str(path))
        out = tmp_path / f"{names[0]}.json"
        flags = ["--query-column", names[0], "--image-column", names[1], "--id-column", names[2]]
        assert main(["eval", str(root / "model"), "--dataset", str(path), "--output", str(out), *flags]) == 0
        results[names[0]] = json.loads(out.read_text())
    default, renamed = results["query"], results["question"]
    assert renamed["counts"]["queries"] == default["counts"]["queries"] == 5
    assert renamed["metrics"] == default["metrics"] and renamed["mean_rank"] == default["mean_rank"]


def test_progress_outside_a_terminal_is_a_plain_line_every_tenth_of_the_calls():
    from raggedvl.evaluation.encode import progress_calls

    stream = io.StringIO()  # not a terminal
    assert list(progress_calls(25, desc="documents", stream=stream)) == list(range(25))
    lines = stream.getvalue().splitlines()
    assert "\r" not in stream.getvalue()
    assert [line.split(" (")[0] for line in lines] == [f"documents: batch {i}/25" for i in (3, 6, 9, 12, 15, 18, 21, 24, 25)]
    assert lines[-1].startswith("documents: batch 25/25 (100 %) ") and lines[-1].endswith("ETA 0:00:00")
    quiet = io.StringIO()
    assert list(progress_calls(5, desc="queries", enabled=False, stream=quiet)) == list(range(5))
    assert quiet.getvalue() == "" and list(progress_calls(0, stream=quiet)) == []


def test_search_refuses_an_index_of_another_model(setup, tmp_path, capsys):
    root, _, bench_dir = setup
    other = build_retriever("tiny", processor=build_processor("tiny"), seed=1)
    other.save_pretrained(tmp_path / "other")
    index = tmp_path / "index-other"
    assert main(["encode", str(tmp_path / "other"), "--dataset", str(bench_dir), "--output", str(index)]) == 0
    capsys.readouterr()
    argv = ["search", str(root / "model"), "--index", str(index), "--query", "sample quantiles"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{index} was encoded by {tmp_path / 'other'}, not by {root / 'model'}" in err, err
    assert main(argv + ["--allow-other-model"]) == 0
    assert "query: sample quantiles" in capsys.readouterr().out


def test_eval_of_a_model_folder_writes_beside_it(setup, tmp_path, monkeypatch):
    root, _, bench_dir = setup
    monkeypatch.chdir(tmp_path)
    assert main(["eval", str(root / "model"), "--dataset", str(bench_dir)]) == 0
    (written,) = (root / "model" / "eval").glob("*bench-test.json")
    assert json.loads(written.read_text())["counts"]["queries"] == 4
    assert list(tmp_path.iterdir()) == []  # nothing in the working directory


def test_a_saved_model_is_encoded_with_its_own_processor(tmp_path):
    """A retriever saved with its processor (RaggedTrainer.save_model, save_pretrained + processor)
    is loaded with that processor's pixel limits, not the preset's defaults."""
    from raggedvl.parallel import init_distributed
    from raggedvl.app.evaluate_checkpoint import load_model

    small = build_processor("tiny", max_pixels=28 * 28 * 16)
    model = build_retriever("tiny", processor=small, seed=0)
    model.save_pretrained(tmp_path / "model")
    small.save_pretrained(tmp_path / "model")
    _, processor, _, _ = load_model(tmp_path / "model", init_distributed().device)
    page = Image.new("RGB", (224, 336), "white")
    expected = small.image_processor(images=[page], return_tensors="pt")["image_grid_thw"]
    got = processor.image_processor(images=[page], return_tensors="pt")["image_grid_thw"]
    default = build_processor("tiny").image_processor(images=[page], return_tensors="pt")["image_grid_thw"]
    assert torch.equal(got, expected) and not torch.equal(got, default)


def test_eval_whose_reader_went_away_runs_to_its_end(setup, tmp_path):
    """``raggedvl eval ... 2>&1 | head`` with the reader gone before the first line: the command's
    progress, table and summary are dropped (``raggedvl.app.closed_output``), it still writes
    the results JSON and exits 0."""
    import subprocess
    import sys

    root, model, bench_dir = setup
    out = tmp_path / "results.json"
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader has gone: every write to the pipe fails with EPIPE
    try:
        done = subprocess.run([sys.executable, "-m", "raggedvl", "eval", str(root / "model"), "--dataset", str(bench_dir),
                               "--output", str(out)], stdout=write_end, stderr=write_end, timeout=600)
    finally:
        os.close(write_end)
    assert done.returncode == 0
    bench = load_benchmark(bench_dir)
    want = score_metrics(brute_force_scores(model, bench), bench.qrels, bench.doc_ids)
    results = json.loads(out.read_text())["metrics"]
    for name in METRICS:  # float32 embeddings of the same weights and images in both processes
        assert results[name] == pytest.approx(want[name], abs=1e-6)

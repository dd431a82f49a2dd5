"""mteb's own evaluation of a raggedvl retriever (``raggedvl.integrations.mteb``) against
``raggedvl eval``'s on the same local ViDoRe-shaped data, ties included."""

import dataclasses
import importlib
import json
import os
import re

import datasets
import huggingface_hub
import mteb
import pytest
import torch
from mteb._evaluators.retrieval_metrics import calculate_retrieval_scores
from mteb.similarity_functions import max_sim
from mteb.tasks.retrieval.eng.vidore_bench_retrieval import VidoreArxivQARetrieval

from raggedvl.data import build_processor
from raggedvl.evaluation.benchmark import load_benchmark
from raggedvl.evaluation.encode import embed_documents, embed_queries, model_collator
from raggedvl.evaluation.evaluator import evaluate_benchmark
from raggedvl.integrations.mteb import MtebEncoder, nan_padded
from raggedvl.models import build_retriever

from ..evaluation.test_benchmark import write_beir
from ..evaluation.test_eval_cli import noise_png

# mteb's score names -> raggedvl's
SCORES = {"ndcg_at_5": "ndcg@5", "ndcg_at_10": "ndcg@10", "map_at_10": "map@10", "mrr_at_10": "mrr@10"}
TWINS = ("doc-7", "doc-8")  # byte-identical pages: every query scores them equal


def local_vidore_task(folder):
    """A ViDoRe v1-shaped mteb task (text queries, an image corpus, graded qrels) whose data
    is the BEIR-layout ``folder``, loaded and renamed as mteb's ViDoRe tasks load theirs."""

    class LocalVidoreRetrieval(VidoreArxivQARetrieval):
        metadata = VidoreArxivQARetrieval.metadata.model_copy(
            update={"name": "LocalVidoreRetrieval", "dataset": {"path": str(folder), "revision": "local"}})

        def load_data(self, num_proc=None, **kwargs):
            table = lambda part: datasets.load_dataset("parquet", data_files=str(folder / f"{part}.parquet"), split="train")  # noqa: E731
            split = "test"
            queries = table("queries").map(lambda x: {"id": f"query-{split}-{x['query-id']}", "text": x["query"],
                                                      "modality": "text"}, remove_columns=["query-id", "query"])
            corpus = table("corpus").map(lambda x: {"id": f"corpus-{split}-{x['corpus-id']}", "modality": "image"},
                                         remove_columns=["corpus-id"])
            relevant: dict = {}
            for row in table("qrels"):
                relevant.setdefault(f"query-{split}-{row['query-id']}", {})[f"corpus-{split}-{row['corpus-id']}"] = int(row["score"])
            self.corpus, self.queries, self.relevant_docs = {split: corpus}, {split: queries}, {split: relevant}
            self.data_loaded = True

    return LocalVidoreRetrieval


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("mteb")
    processor = build_processor("tiny")
    model = build_retriever("tiny", processor=processor, seed=0).to(torch.float64)
    sizes = [(56, 56), (84, 56), (56, 112), (112, 84), (56, 56), (140, 56), (84, 84)]
    corpus = [(f"doc-{i}", noise_png(i, s)) for i, s in enumerate(sizes)]
    twin = noise_png(99, (84, 56))
    corpus += [(TWINS[0], twin), (TWINS[1], twin)]
    queries = [("q1", "sample quantiles"), ("q2", "biplot of data"), ("q3", "writing extensions"), ("q4", "an introduction"),
               ("q5", "regression diagnostics"), ("q6", "package vignettes")]
    # q5 and q6 each judge one twin relevant: where the twins tie, document-id order decides
    qrels = [("q1", "doc-0", 1), ("q1", "doc-3", 2), ("q2", "doc-1", 1), ("q3", "doc-6", 1), ("q4", "doc-2", 3),
             ("q5", TWINS[0], 1), ("q6", TWINS[1], 2), ("q6", "doc-4", 1)]
    folder = write_beir(root / "bench", corpus, queries, qrels)
    return model, processor, folder


def test_mteb_scores_equal_raggedvl_eval_ties_included(setup, tmp_path):
    model, processor, folder = setup
    task = local_vidore_task(folder)()
    encoder = MtebEncoder(model, processor, name="raggedvl/tiny")
    result = mteb.evaluate(encoder, task, cache=None, encode_kwargs={"batch_size": 3}, show_progress_bar=False,
                           prediction_folder=tmp_path)
    (reported,) = result.task_results[0].scores["test"]
    run = json.loads(next(tmp_path.glob("*.json")).read_text())["default"]["test"]  # mteb's ranking: qid -> {doc: score}
    task.load_data()
    qrels = {q: rels for q, rels in task.relevant_docs["test"].items()}
    computed = calculate_retrieval_scores(run, qrels, task.k_values)  # mteb's metric code on mteb's run
    per_query = computed.all_scores.values()
    theirs = {f"ndcg@{k}": sum(s[f"ndcg_cut_{k}"] for s in per_query) / len(per_query) for k in (5, 10)}
    theirs["map@10"] = sum(s["map_cut_10"] for s in per_query) / len(per_query)
    theirs["mrr@10"] = computed.mrr["MRR@10"]

    bench = load_benchmark(folder)
    want = evaluate_benchmark(model, model_collator(model, processor), bench, batch_size=3)
    # Both encode the same items in the same size buckets with the same collator and rank by the
    # same MaxSim function, so the rankings are identical; the metrics then differ only by the
    # summation order of their formulas (pytrec_eval's doubles vs raggedvl's): 1e-6.
    for name in SCORES.values():
        assert theirs[name] == pytest.approx(want[name], abs=1e-6), name
    # what mteb reports: the same means rounded to 5 decimals (within half a unit of the 5th
    # decimal, plus the 1e-6 above)
    for key, name in SCORES.items():
        assert reported[key] == pytest.approx(want[name], abs=5e-6 + 1e-6), key
    assert reported["main_score"] == reported["ndcg_at_5"]

    # the ties happened: every query scores the twins equal (the shared image's embedding)
    q = encoder.similarity(nan_padded(embed_queries(model, bench.queries, processor=processor, progress=False)),
                           nan_padded(embed_documents(model, bench.documents, processor=processor, progress=False)))
    twins = [bench.doc_ids.index(t) for t in TWINS]
    assert torch.equal(q[:, twins[0]], q[:, twins[1]])


def test_similarity_masks_padding_where_zero_padding_would_not(setup):
    model, processor, _ = setup
    # one query vector whose similarity to every document vector is negative: MaxSim takes the
    # best real vector (-0.5); a zero padding vector would win with 0
    query = [torch.tensor([[1.0, 0.0]])]
    docs = [torch.tensor([[-0.5, 0.25]]), torch.tensor([[-1.0, 0.0], [-0.75, 0.5]])]  # lengths 1 and 2 (exact in binary)
    encoder_similarity = MtebEncoder(model, processor).similarity(nan_padded(query), nan_padded(docs))
    assert encoder_similarity.tolist() == [[-0.5, -0.75]]
    zero_padded = torch.nn.utils.rnn.pad_sequence(docs, batch_first=True)
    assert max_sim(query[0][None], zero_padded).tolist() == [[0.0, -0.75]]  # mteb's colpali wrapper's padding
    assert torch.isnan(torch.as_tensor(max_sim(query[0][None], nan_padded(docs)))).any()  # unmasked use fails loudly


def test_eval_cli_mteb_prints_the_main_scores(setup, monkeypatch, capsys, tmp_path):
    from raggedvl.app.cli import main

    model, processor, folder = setup
    model.save_pretrained(tmp_path / "model")
    task = local_vidore_task(folder)
    monkeypatch.setitem(importlib.import_module("mteb.get_tasks")._TASKS_REGISTRY, task.metadata.name, task)
    out = tmp_path / "mteb.json"
    assert main(["eval", str(tmp_path / "model"), "--mteb", task.metadata.name, "--batch-size", "3", "--output", str(out)]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith(f"{task.metadata.name} test default: "))
    printed = dict(re.findall(r"(\w+_at_\d+) ([0-9.]+)", line))
    reloaded = build_retriever(str(tmp_path / "model"), processor=processor)
    want = evaluate_benchmark(reloaded, model_collator(reloaded, processor), load_benchmark(folder), batch_size=3)
    # printed with 5 decimals, mteb's rounding: within half a unit of the 5th decimal (+ 1e-6 as above)
    for key, name in SCORES.items():
        assert float(printed[key]) == pytest.approx(want[name], abs=5e-6 + 1e-6), key
    written = json.loads(out.read_text())
    assert written["tasks"][task.metadata.name]["scores"]["test"][0]["ndcg_at_5"] == pytest.approx(want["ndcg@5"], abs=6e-6)
    assert written["model"]["path"] == str(tmp_path / "model")


def test_eval_cli_mteb_names_the_cache_when_task_data_cannot_load(setup, monkeypatch, capsys, tmp_path):
    from raggedvl.app.cli import main

    model, _, _ = setup
    model.save_pretrained(tmp_path / "model")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty-hf-home"))
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "empty-hf-home" / "datasets")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty-hf-home" / "hub"))
    assert main(["eval", str(tmp_path / "model"), "--mteb", "VidoreArxivQARetrieval"]) == 2
    err = capsys.readouterr().err
    assert "--mteb VidoreArxivQARetrieval: its data (mteb/arxivqa_test_subsampled_beir) could not be loaded" in err
    assert "offline (HF_HUB_OFFLINE=1) mteb reads a task's data from the Hugging Face datasets cache only" in err
    assert main(["eval", str(tmp_path / "model"), "--mteb", "VidoreArxivQA"]) == 2
    assert "Did you mean: 'VidoreArxivQARetrieval'" in capsys.readouterr().err
    assert main(["eval", str(tmp_path / "model"), "--mteb", "VidoreArxivQARetrieval", "--dataset", "x", "--split", "dev"]) == 2
    assert "--mteb scores on mteb's task data, on one process: drop --dataset, --split" in capsys.readouterr().err


def test_eval_cli_mteb_with_the_hub_unreachable_reads_the_cache_without_retrying(setup, monkeypatch, capsys, tmp_path):
    """Online but with the hub unreachable: one metadata request (the probe, with its short
    timeout) finds it out, and the task's data is loaded offline (the hub client's and datasets'
    settings), so no download is retried; an empty cache is then the one-line error naming both."""
    from raggedvl.app import mteb_eval
    from raggedvl.app.cli import main

    model, _, _ = setup
    model.save_pretrained(tmp_path / "model")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty-hf-home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # online; restored after the test (the command sets it)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "empty-hf-home" / "datasets")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty-hf-home" / "hub"))
    probes, loads = [], []

    def unreachable(self, repo_id, **kwargs):
        probes.append((repo_id, kwargs.get("timeout")))
        raise ConnectionError("[Errno -2] Name or service not known")

    task = mteb.get_task("VidoreArxivQARetrieval")
    real_load = type(task).load_data

    def load_data(self, *args, **kwargs):  # the real loading, recording whether it runs offline
        loads.append((huggingface_hub.constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE,
                      os.environ.get("HF_HUB_OFFLINE")))
        return real_load(self, *args, **kwargs)

    monkeypatch.setattr(huggingface_hub.HfApi, "dataset_info", unreachable)
    monkeypatch.setattr(type(task), "load_data", load_data)
    assert main(["eval", str(tmp_path / "model"), "--mteb", "VidoreArxivQARetrieval"]) == 2
    err = capsys.readouterr().err
    assert probes == [("mteb/arxivqa_test_subsampled_beir", mteb_eval.HUB_PROBE_TIMEOUT_S)]
    assert loads == [(True, True, "1")]  # offline from the first request on: the hub client never retries
    assert err.count("\n") == 1 and "--mteb VidoreArxivQARetrieval: its data (mteb/arxivqa_test_subsampled_beir) could " \
        "not be loaded" in err, err
    assert "the hub cannot be reached (ConnectionError: [Errno -2] Name or service not known), so mteb read the " \
        "Hugging Face datasets cache only: check the network, or copy a filled cache under HF_HOME" in err, err


def test_mteb_names_a_benchmark_for_its_tasks(monkeypatch):
    from raggedvl.app import mteb_eval

    monkeypatch.setattr(mteb_eval, "_load_data", lambda task: None)  # names only: no data needed
    names = [task.metadata.name for task in mteb_eval.load_tasks("ViDoRe(v1)")]
    assert names == [task.metadata.name for task in mteb.get_benchmark("ViDoRe(v1)").tasks]
    assert "VidoreArxivQARetrieval" in names and len(names) == 10


@pytest.mark.slow  # builds the run's tiny processor (session data cache) and evaluates twice
def test_a_run_directory_scores_the_same_through_mteb_and_raggedvl_eval(setup, small_data_cache, monkeypatch, capsys, tmp_path):
    from raggedvl.app.checkpoint import CheckpointContents, save_checkpoint
    from raggedvl.app.cli import main
    from raggedvl.app.config import TrainConfig
    from raggedvl.app.setup import build_cfg_processor, build_model

    from ..conftest import SMALL_DEV_PAIRS, SMALL_TRAIN_PAIRS

    _, _, folder = setup
    run = tmp_path / "run"
    cfg = TrainConfig(output_dir=str(run), data_cache=str(small_data_cache), max_train_samples=SMALL_TRAIN_PAIRS,
                      max_eval_samples=SMALL_DEV_PAIRS, max_length=512)
    trained = build_model(dataclasses.replace(cfg, seed=7), build_cfg_processor(cfg))  # weights the run's seed does not build
    save_checkpoint(run / "checkpoints", 5, CheckpointContents(
        model_state=trained.state_dict(), optimizer_state={}, rng_states=[],
        trainer_state={"step": 5, "epoch": 0, "world_size": 1, "config": cfg.to_dict()}))
    task = local_vidore_task(folder)
    monkeypatch.setitem(importlib.import_module("mteb.get_tasks")._TASKS_REGISTRY, task.metadata.name, task)
    assert main(["eval", str(run), "--mteb", task.metadata.name, "--batch-size", "3", "--output", str(tmp_path / "m.json")]) == 0
    assert main(["eval", str(run), "--dataset", str(folder), "--batch-size", "3", "--output", str(tmp_path / "r.json")]) == 0
    capsys.readouterr()
    (theirs,) = json.loads((tmp_path / "m.json").read_text())["tasks"][task.metadata.name]["scores"]["test"]
    ours = json.loads((tmp_path / "r.json").read_text())
    assert ours["model"]["step"] == 5
    # mteb rounds to 5 decimals (half a unit) on top of the 1e-6 of the first test
    for key, name in SCORES.items():
        assert theirs[key] == pytest.approx(ours["metrics"][name], abs=5e-6 + 1e-6), key

"""`raggedvl train --batch-sampling one-source` end to end (one process, tiny preset, data built
here): two datasets with hard negatives under GradCache and packing, and a source column within
one parquet file. metrics.jsonl names each step's source, and the plan the run trained on (the
sampler rebuilt from the run's saved config and data) holds only that source's rows in that
step; a run stopped and resumed repeats the uninterrupted run's losses bit for bit."""

from __future__ import annotations

import json
import shutil

import datasets
import pytest
import torch

from raggedvl.app.cli import main
from raggedvl.parallel import DistInfo
from raggedvl.app.checkpoint import list_checkpoints
from raggedvl.app.config import TRAIN_CONFIG_NAME, TrainConfig
from raggedvl.app.setup import make_sampler, prepare_run_data, row_sources
from tests.data.test_negatives import image, negatives_parquet

pytestmark = pytest.mark.slow  # tiny model, a few training steps


def _records(run_dir, event="train"):
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r.get("event") == event]


def _train(run_dir, cache, *argv):
    assert main(["train", "--max-steps", "4", "--global-batch-size", "4", "--checkpoint-every", "2",
                 "--eval-before", "false", "--eval-after", "false", "--output-dir", str(run_dir),
                 "--data-cache", str(cache), *argv]) == 0


def _trained_plan(run_dir, steps):
    """[(source, global batch rows, training set)] of the run's first ``steps`` steps: the
    sampler rebuilt from the run's own config and data (one process), epoch after epoch."""
    cfg = TrainConfig.from_dict(json.loads((run_dir / TRAIN_CONFIG_NAME).read_text()))
    data = prepare_run_data(cfg, warn=False)
    info = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="none")
    sampler = make_sampler(cfg, data.costs, info, data.train_set.part_sizes, row_sources(cfg, data.train_set))
    out, epoch = [], 0
    while len(out) < steps:
        sampler.set_epoch(epoch)
        out += [(sampler.step_source(k), rows, data.train_set) for k, rows in enumerate(sampler)]
        epoch += 1
    return out[:steps]


def _resume_from_step_2(run_dir, tmp_path, cache, *argv):
    """A copy of ``run_dir`` stopped after step 2 (later checkpoints and log lines dropped),
    resumed to step 4; returns the resumed run's train records."""
    resumed = tmp_path / "resumed"
    shutil.copytree(run_dir, resumed)
    for ckpt in list_checkpoints(resumed / "checkpoints"):
        if ckpt.name != "step-000002":
            shutil.rmtree(ckpt)
    lines = (resumed / "metrics.jsonl").read_text().splitlines()
    kept = [line for line in lines if json.loads(line).get("event") != "train" or json.loads(line)["step"] <= 2]
    (resumed / "metrics.jsonl").write_text("\n".join(kept) + "\n")
    _train(resumed, cache, *argv, "--resume")
    return _records(resumed)


def test_two_datasets_one_source_batches_with_negatives_gradcache_and_packing_resume_exactly(
        tmp_path, monkeypatch, small_data_cache):
    monkeypatch.setenv("LOCAL_RANK", "0")  # as under torchrun: train in this process (world size 1)
    paths = [negatives_parquet(tmp_path / "a.parquet", n=6, k=1), negatives_parquet(tmp_path / "b.parquet", n=5, k=1)]
    argv = [a for p in paths for a in ("--dataset", p)] + [
        "--batch-sampling", "one-source", "--dataset-weights", "1,1", "--negatives-column", "negs", "--grad-cache",
        "--grad-cache-budget", "64", "--packing"]
    straight = tmp_path / "straight"
    _train(straight, small_data_cache, *argv)
    steps = _records(straight)
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    plan = _trained_plan(straight, 4)
    for record, (source, rows, train_set) in zip(steps, plan):
        assert record["source"] == source in paths
        assert record["hard_negatives"] == len(rows) == 4 and sum(record["rank_samples"]) == 4
        first = paths.index(source) * 6  # a.parquet holds rows 0-5 of the concatenation, b.parquet 6-10
        assert all(first <= i < first + (6, 5)[paths.index(source)] for i in rows), (record["step"], rows)
        assert {train_set.records[i]["dataset"] for i in rows} == {f"{source} split 'train'"}
    assert {r["source"] for r in steps} == set(paths)  # with this seed both sources occur in 4 steps
    state = json.loads((straight / "checkpoints" / "step-000004" / "trainer_state.json").read_text())
    assert state["sampler"]["mixture"] == {"sizes": [6, 5], "weights": [0.5, 0.5], "one_source": True}
    counts = {p: sum(r["source"] == p for r in steps) for p in paths}
    assert (f"steps per source in this invocation: {paths[0]} {counts[paths[0]]}, {paths[1]} {counts[paths[1]]}"
            in (straight / "summary.md").read_text())

    again = _resume_from_step_2(straight, tmp_path, small_data_cache, *argv)
    assert [r["step"] for r in again] == [1, 2, 3, 4]
    # same process count, same plan, same RNG state: the same float operations, so equal bits
    assert [(r["source"], r["loss"], r["grad_norm"]) for r in again] == [(r["source"], r["loss"], r["grad_norm"])
                                                                          for r in steps]


def _sources_parquet(path, kinds):
    """One row per entry of ``kinds``: a distinct page, its question and its ``kind``."""
    n = len(kinds)
    data = {"query": [f"question {i}" for i in range(n)], "image": [image(i) for i in range(n)], "kind": kinds}
    features = datasets.Features({"query": datasets.Value("string"), "image": datasets.Image(),
                                  "kind": datasets.Value("string")})
    datasets.Dataset.from_dict(data, features=features).to_parquet(str(path))
    return str(path)


def test_a_source_column_within_one_parquet_file(tmp_path, monkeypatch, small_data_cache):
    monkeypatch.setenv("LOCAL_RANK", "0")
    kinds = ["slide", "scan", "scan", "slide", "chart", "scan", "slide", "scan", "chart", "slide", "scan", "chart"]
    path = _sources_parquet(tmp_path / "pages.parquet", kinds)
    run = tmp_path / "run"
    _train(run, small_data_cache, "--dataset", path, "--source-column", "kind", "--batch-sampling", "one-source",
           "--dataset-weights", "0,2,1")  # the values in sorted order: chart, scan, slide
    steps = _records(run)
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    for record, (source, rows, train_set) in zip(steps, _trained_plan(run, 4)):
        assert record["source"] == source in ("scan", "slide")  # chart has weight 0
        assert len(rows) == 4 and {kinds[train_set.records[i]["row"]] for i in rows} == {source}
    config = _records(run, "config")[0]
    assert (config["source_column"], config["dataset_weights"]) == ("kind", [0, 2, 1])
    state = json.loads((run / "checkpoints" / "step-000004" / "trainer_state.json").read_text())
    # sources sorted by name: chart, scan, slide; weights 0, 2/3, 1/3
    assert state["sampler"]["mixture"]["sizes"] == [3, 5, 4]
    assert state["sampler"]["mixture"]["weights"] == pytest.approx([0, 2 / 3, 1 / 3], abs=1e-12)


def test_a_missing_source_column_or_value_is_a_one_line_error_before_any_process(tmp_path, capsys):
    path = _sources_parquet(tmp_path / "pages.parquet", ["a", "b", "a", "b"])
    code = main(["train", "--dataset", path, "--source-column", "knd", "--batch-sampling", "one-source",
                 "--output-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert "has no source column 'knd'" in err and "did you mean 'kind'?" in err and "--source-column" in err, err
    path = _sources_parquet(tmp_path / "holes.parquet", ["a", None, "a", "b"])
    code = main(["train", "--dataset", path, "--source-column", "kind", "--batch-sampling", "one-source",
                 "--max-train-samples", "none", "--output-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert "row 1 (id 'train-1') has no value in the source column 'kind'; fill it in" in err, err
    code = main(["train", "--dataset", path.replace("holes", "pages"), "--source-column", "kind", "--batch-sampling",
                 "one-source", "--dataset-weights", "1,2,3", "--output-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert ("dataset_weights has 3 values [1.0, 2.0, 3.0] for the 2 values of source column 'kind': 'a' (2 rows), "
            "'b' (2 rows); give one weight per value, in this order" in err), err


def test_a_manifest_key_is_a_source_column(small_data_cache):
    """rdocs rows carry ``source`` (how the page's query was made: outline or help_title)."""
    from tests.conftest import SMALL_DEV_PAIRS, SMALL_TRAIN_PAIRS

    cfg = TrainConfig(source_column="source", batch_sampling="one-source", global_batch_size=4,
                      max_train_samples=SMALL_TRAIN_PAIRS, max_eval_samples=SMALL_DEV_PAIRS, eval_before=False,
                      eval_after=False, data_cache=str(small_data_cache))
    data = prepare_run_data(cfg, warn=False)
    values = row_sources(cfg, data.train_set)
    assert values == [r["source"] for r in data.train_set.records] and set(values) == {"outline", "help_title"}
    info = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="none")
    sampler = make_sampler(cfg, data.costs, info, data.train_set.part_sizes, values)
    assert sampler.mixture.names == tuple(sorted(set(values)))
    for k, rows in enumerate(sampler):
        assert {values[i] for i in rows} == {sampler.step_source(k)}
    with pytest.raises(ValueError, match=r"has no 'sorce' \(keys present: .*\); pass --source-column naming a key"):
        prepare_run_data(TrainConfig(**{**cfg.to_dict(), "source_column": "sorce"}), warn=False)

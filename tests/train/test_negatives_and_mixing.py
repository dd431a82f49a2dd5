"""`raggedvl train` with a hard-negatives column and several weighted datasets:
the training loss equals the loss's own hard-negative path on the same embeddings, a parquet
with a negatives column and two mixed datasets train from the CLI, a resumed mixed run repeats
the uninterrupted run's steps, and bad weights are one-line errors before any process starts."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from raggedvl.app.cli import main
from raggedvl.parallel import init_distributed
from raggedvl.app import launch
from raggedvl.app.checkpoint import list_checkpoints
from raggedvl.app.config import TrainConfig
from raggedvl.app.loop import Trainer
from tests.data.test_negatives import negatives_parquet

pytestmark = pytest.mark.slow  # tiny model, a few training steps


def test_the_training_loss_is_the_losses_hard_negative_path(tmp_path, small_data_cache):
    path = negatives_parquet(tmp_path / "negs.parquet", n=8, k=2)
    cfg = TrainConfig(dataset=path, negatives_column="negs", max_steps=2, global_batch_size=4, eval_before=False,
                      eval_after=False, output_dir=str(tmp_path / "run"), data_cache=str(small_data_cache))
    trainer = Trainer(cfg, init_distributed())
    indices = next(iter(trainer.c.sampler))
    batch = trainer.c.collate([trainer.c.train_set[i] for i in indices])
    model = trainer.c.model.train()
    with torch.no_grad():  # three separate encodes, before the step changes the weights
        q, d, n = (model(**batch[key]) for key in ("queries", "docs", "negatives"))
        expected = float(trainer.c.loss(q, d, n))  # the loss's own hard-negative path
        without = float(trainer.c.loss(q, d))
    got = trainer.train_step(batch).loss  # one encode of docs + negatives, split, then the same loss
    assert n.embeddings.shape[0] == 2 * d.embeddings.shape[0] == 2 * len(indices)
    assert got == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert abs(got - without) > 1e-3  # the negatives do change the loss


def _records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _cli(run_dir, cache, paths, *extra):
    argv = ["train", *[a for p in paths for a in ("--dataset", p)], "--negatives-column", "negs",
            "--dataset-weights", "0.7,0.3", "--max-steps", "4", "--global-batch-size", "4", "--checkpoint-every", "2",
            "--eval-before", "false", "--eval-after", "false", "--output-dir", str(run_dir), "--data-cache", str(cache),
            *extra]
    assert main(argv) == 0


def test_two_weighted_datasets_with_negatives_train_and_resume_identically(tmp_path, monkeypatch, small_data_cache):
    monkeypatch.setenv("LOCAL_RANK", "0")  # as under torchrun: train in this process (world size 1)
    paths = [negatives_parquet(tmp_path / "a.parquet", n=6, k=1), negatives_parquet(tmp_path / "b.parquet", n=5, k=1)]
    straight = tmp_path / "straight"
    _cli(straight, small_data_cache, paths)
    steps = [r for r in _records(straight) if r.get("event") == "train"]
    assert [r["step"] for r in steps] == [1, 2, 3, 4] and all(r["loss"] == r["loss"] for r in steps)
    assert not any("source" in r for r in steps)  # mixed batches (the default) have no one source per step
    config = next(r for r in _records(straight) if r.get("event") == "config")
    assert config["dataset"] == paths and config["dataset_weights"] == [0.7, 0.3] and config["negatives_column"] == "negs"
    state = json.loads((straight / "checkpoints" / "step-000004" / "trainer_state.json").read_text())
    assert state["sampler"]["mixture"] == {"sizes": [6, 5], "weights": [0.7, 0.3]}  # the mixing sampler's position
    # 11 rows, global batch 4: 3 steps per epoch (the remainder of 3 is a step), so step 4 is epoch 1's first
    assert (state["sampler"]["epoch"], state["sampler"]["step"]) == (1, 1)
    # stop after step 2 (drop the later checkpoint) and resume: steps 3 and 4 repeat exactly
    resumed = tmp_path / "resumed"
    shutil.copytree(straight, resumed)
    for ckpt in list_checkpoints(resumed / "checkpoints"):
        if ckpt.name != "step-000002":
            shutil.rmtree(ckpt)
    _cli(resumed, small_data_cache, paths, "--resume")
    again = {r["step"]: r["loss"] for r in _records(resumed) if r.get("event") == "train"}
    for r in steps[2:]:
        assert again[r["step"]] == pytest.approx(r["loss"], rel=1e-6), r["step"]


@pytest.mark.parametrize("argv, message", [
    (["--dataset", "a.parquet", "--dataset", "b.parquet", "--dataset-weights", "0.7,0.2,0.1"],
     "dataset_weights has 3 values [0.7, 0.2, 0.1] for 2 datasets ['a.parquet', 'b.parquet']; give one weight per dataset"),
    (["--dataset", "a.parquet", "--dataset", "b.parquet", "--dataset-weights", "0.7,-0.3"],
     "--dataset-weights must be >= 0, got -0.3"),
    (["--dataset", "a.parquet", "--dataset", "b.parquet", "--dataset-weights", "0,0"],
     "dataset_weights [0.0, 0.0] are all 0; give at least one source a positive weight"),
])
def test_bad_weights_are_one_line_errors_before_any_process_starts(capsys, tmp_path, monkeypatch, argv, message):
    def refuse(cmd, env_updates=None):
        raise AssertionError(f"the launcher would have started {cmd}")

    monkeypatch.setattr(launch, "exec_agent", refuse)
    monkeypatch.setattr(launch, "check_names", lambda cfg: pytest.fail("checked names after a config error"))
    code = main(["train", "--output-dir", str(tmp_path / "run"), *argv])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("raggedvl: error: "), err
    assert message in err, err


def test_yaml_takes_a_list_of_datasets_and_weights(tmp_path):
    (tmp_path / "mix.yaml").write_text("dataset: [a.parquet, b.parquet]\ndataset_weights: [3, 1]\nnegatives_column: negs\n")
    cfg = TrainConfig.from_yaml(tmp_path / "mix.yaml")
    assert cfg.datasets == ["a.parquet", "b.parquet"] and cfg.dataset_weights == [3, 1]
    assert TrainConfig(dataset=["only.parquet"]).dataset == "only.parquet"  # one entry is the plain name
    with pytest.raises(ValueError, match="config key 'dataset_weights' must be a list of float"):
        TrainConfig(dataset=["a", "b"], dataset_weights=0.5)


def _identical_pages_with_negatives(path, n, k):
    """``n`` rows whose page and ``k`` hard negatives are all the same white image: every
    candidate scores alike for every query, so the loss is exactly its chance value."""
    import io

    import datasets
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (112, 112), "white").save(buffer, format="PNG")
    page = {"bytes": buffer.getvalue(), "path": None}
    data = {"query": [f"question number {i}" for i in range(n)], "image": [page] * n, "negs": [[page] * k] * n}
    features = datasets.Features({"query": datasets.Value("string"), "image": datasets.Image(),
                                  "negs": datasets.List(datasets.Image())})
    datasets.Dataset.from_dict(data, features=features).to_parquet(str(path))
    return str(path)


def test_with_hard_negatives_the_chance_loss_counts_them_every_step(tmp_path, small_data_cache):
    """10 rows with 2 hard negatives each, global batch 4, 3 steps: each query competes against the
    step's N pairs and 2N negatives, so equal scores give ln(3N) (ln 12 for a full step), not
    ln(global batch) = ln 4. metrics.jsonl records both counts and the value per step, the loss
    sits on it, and the collapse check, its event and summary.md use it."""
    import math

    from raggedvl.app.loop import train

    path = _identical_pages_with_negatives(tmp_path / "same.parquet", n=10, k=2)
    run = tmp_path / "run"
    summary = train(TrainConfig(dataset=path, negatives_column="negs", max_steps=3, global_batch_size=4, warmup_steps=1,
                                eval_before=False, eval_after=False, collapse_patience=2, checkpoint_every=100,
                                output_dir=str(run), data_cache=str(small_data_cache),
                                false_negatives="keep"))  # identical pages: masked, no candidate would be left
    records = _records(run)
    steps = [r for r in records if r.get("event") == "train"]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r in steps:
        pairs = sum(r["rank_samples"])
        assert r["hard_negatives"] == 2 * pairs
        assert r["chance_loss"] == pytest.approx(math.log(pairs + r["hard_negatives"]))
        assert r["loss"] == pytest.approx(r["chance_loss"], abs=1e-4)  # identical candidates: exactly at chance
    assert steps[0]["chance_loss"] == pytest.approx(math.log(12))
    assert summary["collapsed"]
    (event,) = [r for r in records if r.get("event") == "collapse"]
    assert event["step"] == 2 and event["chance"] == pytest.approx(math.log(12)) and event["hard_negatives"] == 8
    text = (run / "summary.md").read_text()
    chances = {round(r["chance_loss"], 3) for r in steps}
    if len(chances) == 1:
        assert f"chance loss (every document scoring the same): ln(4 pairs + 8 hard negatives) = {math.log(12):.3f}" in text
    else:  # a last, smaller step of the epoch
        assert f"ln(pairs + hard negatives) of each step, {min(chances):.3f}-{max(chances):.3f}" in text
    assert f"the loss sat at its chance value {math.log(12):.4f}" in text  # the value of the step it fired at
    assert "ln(global batch)" not in text

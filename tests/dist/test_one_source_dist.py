"""`raggedvl train --batch-sampling one-source` under torchrun (2 gloo processes): every step's
logged source is the one the single-process sampler draws for that step (the source depends
only on seed, epoch and step), each rank trained its share of that source's global batch, and a
run stopped after step 2 and resumed repeats the uninterrupted run's per-step losses bit for bit."""

import json
import os
import shutil
import sys

import pytest
import torch

from raggedvl.parallel import DistInfo
from raggedvl.app.checkpoint import list_checkpoints
from raggedvl.app.config import TRAIN_CONFIG_NAME, TrainConfig
from raggedvl.app.setup import make_sampler, prepare_run_data, row_sources
from tests.data.test_negatives import negatives_parquet
from tests.jobs import TRAIN_READY, run_job

pytestmark = [pytest.mark.dist, pytest.mark.slow]


def _train(run_dir, cache, paths, *extra, timeout=240):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("RAGGEDVL_FAULT", None)
    cmd = [sys.executable, "-m", "raggedvl.app.cli", "train", "--nproc-per-node", "2",
           *[a for p in paths for a in ("--dataset", p)], "--batch-sampling", "one-source", "--max-steps", "4",
           "--checkpoint-every", "2", "--global-batch-size", "4", "--eval-before", "false", "--eval-after", "false",
           "--data-workers", "1", "--output-dir", str(run_dir), "--data-cache", str(cache), *extra]
    result = run_job(cmd, env=env, ready=TRAIN_READY, timeout=timeout)
    assert result.returncode == 0, result.describe()


def _steps(run_dir):
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r.get("event") == "train"]


def _plans(run_dir, world_sizes, steps):
    """{W: [(source, [rank lists])] of the first ``steps`` steps} of the run's sampler, all ranks
    simulated in this process."""
    cfg = TrainConfig.from_dict(json.loads((run_dir / TRAIN_CONFIG_NAME).read_text()))
    data = prepare_run_data(cfg, warn=False)
    out = {}
    for w in world_sizes:
        samplers = [make_sampler(cfg, data.costs, DistInfo(r, w, r, torch.device("cpu"), "gloo"),
                                 data.train_set.part_sizes, row_sources(cfg, data.train_set)) for r in range(w)]
        plan, epoch = [], 0
        while len(plan) < steps:
            for s in samplers:
                s.set_epoch(epoch)
            per_rank = [list(s) for s in samplers]
            plan += [(samplers[0].step_source(k), parts) for k, parts in enumerate(zip(*per_rank))]
            epoch += 1
        out[w] = plan[:steps]
    return out


def test_two_processes_draw_each_step_from_one_source_and_resume_exactly(tmp_path, small_data_cache):
    paths = [negatives_parquet(tmp_path / "a.parquet", n=8, k=1), negatives_parquet(tmp_path / "b.parquet", n=6, k=1)]
    full = tmp_path / "full"
    _train(full, small_data_cache, paths)
    steps = _steps(full)
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    plans = _plans(full, (1, 2), 4)
    for record, (source, parts), (single, whole) in zip(steps, plans[2], plans[1]):
        assert record["source"] == source == single  # the same source for 1 and 2 processes
        first, size = (0, 8) if source == paths[0] else (8, 6)
        assert all(first <= i < first + size for part in parts for i in part)
        assert record["rank_samples"] == [len(part) for part in parts] and min(record["rank_samples"]) >= 1
        assert sorted(i for part in parts for i in part) == sorted(whole[0])  # the same global batch
    assert {r["source"] for r in steps} == set(paths)  # with this seed both sources occur in 4 steps

    resumed = tmp_path / "resumed"
    shutil.copytree(full, resumed)
    for ckpt in list_checkpoints(resumed / "checkpoints"):
        if ckpt.name != "step-000002":
            shutil.rmtree(ckpt)
    lines = (resumed / "metrics.jsonl").read_text().splitlines()
    (resumed / "metrics.jsonl").write_text("\n".join(
        line for line in lines if json.loads(line).get("event") != "train" or json.loads(line)["step"] <= 2) + "\n")
    _train(resumed, small_data_cache, paths, "--resume")
    again = _steps(resumed)
    assert [r["step"] for r in again] == [1, 2, 3, 4]
    # same 2 processes, same plan, same RNG and weights: the same float operations, so equal bits
    assert [(r["source"], r["loss"], r["rank_samples"]) for r in again] == [
        (r["source"], r["loss"], r["rank_samples"]) for r in steps]

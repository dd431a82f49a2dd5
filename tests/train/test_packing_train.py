"""`raggedvl train --packing true`: the same per-step losses as the padded run (one process,
rdocs subset, 2 steps of global batch 4, evaluation off), and the model really packs."""

import json

import pytest

from raggedvl.models.packed_attention import PACKED_SDPA, text_attention
from raggedvl.app.config import TrainConfig
import torch

from raggedvl.parallel.runtime import DistInfo
from raggedvl.app.loop import train
from raggedvl.app.setup import build_components
from tests.conftest import SMALL_DEV_PAIRS, SMALL_TRAIN_PAIRS

pytestmark = pytest.mark.slow  # two 2-step runs of the tiny model (~40 s idle)


def _losses(tmp_path, cache, packing: bool) -> list[float]:
    cfg = TrainConfig(max_steps=2, global_batch_size=4, eval_before=False, eval_after=False, checkpoint_every=100,
                      max_train_samples=SMALL_TRAIN_PAIRS, max_eval_samples=SMALL_DEV_PAIRS, packing=packing,
                      output_dir=str(tmp_path / f"run-{packing}"), data_cache=str(cache))
    train(cfg)
    records = [json.loads(line) for line in (tmp_path / f"run-{packing}" / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if r.get("event") == "train"]


def test_packed_training_logs_the_padded_losses(tmp_path, small_data_cache):
    padded = _losses(tmp_path, small_data_cache, packing=False)
    packed = _losses(tmp_path, small_data_cache, packing=True)
    assert len(padded) == len(packed) == 2
    assert all(loss > 0.1 for loss in padded)
    assert max(abs(a - b) for a, b in zip(packed, padded)) < 1e-4, (packed, padded)


def test_the_packing_flag_reaches_the_model(tmp_path, small_data_cache):
    cfg = TrainConfig(max_steps=1, global_batch_size=4, eval_before=False, eval_after=False, packing=True,
                      max_train_samples=SMALL_TRAIN_PAIRS, max_eval_samples=SMALL_DEV_PAIRS,
                      output_dir=str(tmp_path / "run"), data_cache=str(small_data_cache))
    model = build_components(cfg, DistInfo(0, 1, 0, torch.device("cpu"), "none")).model
    assert model.packing and text_attention(model.base_model) == PACKED_SDPA

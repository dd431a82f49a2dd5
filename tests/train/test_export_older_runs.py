"""`raggedvl export` of a run made before checkpoints held the retriever's settings (weights as
``model.safetensors``, no ``raggedvl_retriever.json`` or processor files): the retriever is
rebuilt from the run's config in ``trainer_state.json`` and exported with the checkpoint's
weights, which the exported folder gives back (same embeddings on the colpali fixture inputs)."""

import dataclasses
import hashlib
import json

import pytest
import torch

from raggedvl.app.cli import main
from raggedvl.models import build_retriever
from raggedvl.app.checkpoint import MANIFEST
from raggedvl.models.weights import save_tensors
from raggedvl.app.config import TrainConfig
from raggedvl.app.setup import build_cfg_processor, build_model
from tests.conftest import SMALL_DEV_PAIRS, SMALL_TRAIN_PAIRS
from tests.models.interop.helpers import encode, masked_max_abs

pytestmark = pytest.mark.slow  # builds, exports and reloads the tiny retriever


def _older_checkpoint(run, cfg: TrainConfig, model) -> None:
    """The single-file layout raggedvl wrote before `raggedvl export` existed (as found in such runs)."""
    folder = run / "checkpoints" / "step-000005"
    folder.mkdir(parents=True)
    save_tensors(folder / "model.safetensors", {k: v.clone() for k, v in model.state_dict().items()})
    torch.save({}, folder / "optimizer.pt")
    torch.save([], folder / "rng.pt")
    state = {"step": 5, "epoch": 0, "world_size": 1, "config": cfg.to_dict()}
    (folder / "trainer_state.json").write_text(json.dumps(state))
    files = {p.name: {"bytes": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
             for p in folder.iterdir()}
    (folder / MANIFEST).write_text(json.dumps({"step": 5, "files": files}))
    assert sorted(p.name for p in folder.iterdir()) == [MANIFEST, "model.safetensors", "optimizer.pt", "rng.pt",
                                                        "trainer_state.json"]


def test_a_run_from_before_export_exports_with_its_weights(tmp_path, small_data_cache, capsys):
    cfg = TrainConfig(output_dir=str(tmp_path / "run"), data_cache=str(small_data_cache),
                      max_train_samples=SMALL_TRAIN_PAIRS, max_eval_samples=SMALL_DEV_PAIRS)
    trained = build_model(dataclasses.replace(cfg, seed=7), build_cfg_processor(cfg))  # not what cfg's seed builds
    _older_checkpoint(tmp_path / "run", cfg, trained)
    out = tmp_path / "colpali"
    assert main(["export", str(tmp_path / "run"), "--format", "colpali", "--output", str(out)]) == 0
    assert "predates saved retriever settings: rebuilt from its run's config" in capsys.readouterr().err
    exported = build_retriever(str(out))
    batch, q_want, d_want = encode(trained, out)
    _, q_got, d_got = encode(exported, out)
    assert masked_max_abs(q_got.embeddings, q_want.embeddings, batch["queries"]["attention_mask"]) < 1e-5
    assert masked_max_abs(d_got.embeddings, d_want.embeddings, batch["docs"]["attention_mask"]) < 1e-5
    fresh = build_model(cfg, build_cfg_processor(cfg))  # the rebuild before the weights are loaded differs
    _, q_fresh, _ = encode(fresh, out)
    assert not torch.allclose(q_fresh.embeddings, q_want.embeddings)
    assert "step 5" in (out / "README.md").read_text()  # the model card names the checkpoint's step

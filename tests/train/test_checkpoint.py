import json
import os
import pickle
from pathlib import Path

import pytest
import torch

from raggedvl.app.checkpoint import (
    CheckpointError,
    list_checkpoints,
    load_checkpoint,
    load_checkpoint_or_latest,
    load_latest_checkpoint,
    save_checkpoint,
)
from raggedvl.rng import capture_rng_state, restore_rng_state


def _save(root, step, value=1.0, keep=2):
    model = {"w": torch.full((3, 2), value), "tied": torch.arange(4.0)}
    model["tied_alias"] = model["tied"]  # shared storage, as with tied embeddings
    return save_checkpoint(
        root, step, model_state=model, optimizer_state={"state": {0: {"exp_avg": torch.ones(2)}}, "param_groups": [{"lr": 0.1, "params": [0]}]},
        rng_states=[capture_rng_state(), capture_rng_state()], trainer_state={"step": step, "sampler": {"epoch": 0, "position": step}},
        keep=keep,
    )


def test_round_trip_and_pruning(tmp_path):
    for step, v in ((1, 1.0), (2, 2.0), (3, 3.0)):
        _save(tmp_path, step, v)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-000003", "step-000002"]
    ckpt, problems = load_latest_checkpoint(tmp_path)
    assert problems == []
    assert ckpt.state["step"] == 3
    torch.testing.assert_close(ckpt.model["w"], torch.full((3, 2), 3.0))
    torch.testing.assert_close(ckpt.model["tied_alias"], torch.arange(4.0))
    assert ckpt.optimizer["param_groups"][0]["lr"] == 0.1
    assert not any(".tmp" in p.name for p in tmp_path.iterdir())


def test_rng_round_trip_through_checkpoint(tmp_path):
    torch.manual_seed(123)
    path = _save(tmp_path, 1)
    expected = torch.rand(5)
    torch.manual_seed(999)
    restore_rng_state(load_checkpoint(path).rng[1])
    torch.testing.assert_close(torch.rand(5), expected)


@pytest.mark.parametrize("damage", ["truncate", "flip", "no_manifest"])
def test_torn_checkpoint_falls_back_to_previous_good(tmp_path, damage):
    _save(tmp_path, 1, 1.0)
    newest = _save(tmp_path, 2, 2.0)
    target = newest / "raggedvl_retriever.safetensors"
    if damage == "truncate":
        data = target.read_bytes()
        target.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        data = bytearray(target.read_bytes())
        data[-1] ^= 0xFF
        target.write_bytes(bytes(data))
    else:
        (newest / "MANIFEST.json").unlink()
    with pytest.raises(CheckpointError, match="step-000002"):
        load_checkpoint(newest)
    ckpt, problems = load_latest_checkpoint(tmp_path)
    assert ckpt.state["step"] == 1 and len(problems) == 1 and "step-000002" in problems[0]


class _Payload:
    def __reduce__(self):
        return (os.system, ("echo pwned > /tmp/raggedvl-pwned",))


def test_pickle_payload_is_refused(tmp_path):
    path = _save(tmp_path, 1)
    bad = path / "optimizer.pt"
    torch.save({"state": _Payload()}, bad)
    # A crafted checkpoint carries a manifest that matches its files.
    manifest = json.loads((path / "MANIFEST.json").read_text())
    import hashlib

    manifest["files"]["optimizer.pt"] = {"bytes": bad.stat().st_size, "sha256": hashlib.sha256(bad.read_bytes()).hexdigest()}
    (path / "MANIFEST.json").write_text(json.dumps(manifest))
    if os.path.exists("/tmp/raggedvl-pwned"):
        os.remove("/tmp/raggedvl-pwned")
    with pytest.raises(CheckpointError, match="refusing to load"):
        load_checkpoint(path)
    assert not os.path.exists("/tmp/raggedvl-pwned")
    assert isinstance(pickle.UnpicklingError("x"), Exception)


def test_eval_resolves_a_run_dir_to_the_newest_checkpoint_that_verifies(tmp_path):
    older = _save(tmp_path, 1, 1.0)
    newest = _save(tmp_path, 2, 2.0)
    assert load_checkpoint_or_latest(tmp_path).path == newest
    assert load_checkpoint_or_latest(older).path == older  # a checkpoint folder is taken as given
    (newest / "MANIFEST.json").unlink()
    assert load_checkpoint_or_latest(tmp_path).path == older
    (older / "MANIFEST.json").unlink()
    with pytest.raises(CheckpointError, match="no checkpoint verifies"):
        load_checkpoint_or_latest(tmp_path)
    with pytest.raises(CheckpointError, match="neither a checkpoint folder nor a run directory"):
        load_checkpoint_or_latest(tmp_path / "elsewhere")


def test_each_checkpoint_is_hashed_once_when_loaded(tmp_path, monkeypatch):
    import raggedvl.app.checkpoint as checkpoint

    _save(tmp_path, 1, 1.0)
    newest = _save(tmp_path, 2, 2.0)
    hashed = []
    real = checkpoint._sha256
    monkeypatch.setattr(checkpoint, "_sha256", lambda p: hashed.append(Path(p)) or real(p))
    for load in (lambda: load_latest_checkpoint(tmp_path)[0], lambda: load_checkpoint_or_latest(tmp_path)):
        hashed.clear()
        assert load().path == newest
        assert sorted(hashed) == sorted(newest / name for name in checkpoint.FILES)

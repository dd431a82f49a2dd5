import json
import os
import pickle
from pathlib import Path

import pytest
import torch

from raggedvl.app.checkpoint import (
    CheckpointContents,
    CheckpointError,
    checkpoint_weights,
    list_checkpoints,
    load_checkpoint,
    load_checkpoint_or_latest,
    load_latest_checkpoint,
    save_checkpoint,
)
from raggedvl.parallel import read_sharded
from raggedvl.rng import capture_rng_state, restore_rng_state


def _save(root, step, value=1.0, keep=2):
    model = {"w": torch.full((3, 2), value), "tied": torch.arange(4.0)}
    model["tied_alias"] = model["tied"]  # shared storage, as with tied embeddings
    contents = CheckpointContents(
        model_state=model, optimizer_state={"state": {0: {"exp_avg": torch.ones(2)}}, "param_groups": [{"lr": 0.1, "params": [0]}]},
        rng_states=[capture_rng_state(), capture_rng_state()], trainer_state={"step": step, "sampler": {"epoch": 0, "position": step}},
    )
    return save_checkpoint(root, step, contents, keep=keep)


def test_round_trip_and_pruning(tmp_path):
    for step, v in ((1, 1.0), (2, 2.0), (3, 3.0)):
        _save(tmp_path, step, v)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-000003", "step-000002"]
    ckpt, problems = load_latest_checkpoint(tmp_path)
    assert problems == []
    assert ckpt.state["step"] == 3
    weights = checkpoint_weights(ckpt.path)  # consolidated in this process from the DCP folder
    torch.testing.assert_close(weights["w"], torch.full((3, 2), 3.0))
    torch.testing.assert_close(weights["tied_alias"], torch.arange(4.0))
    optimizer = {"state": {0: {"exp_avg": torch.zeros(2)}}, "param_groups": [{"lr": 0.0, "params": [0]}]}
    read_sharded(ckpt.path / "optimizer", optimizer)  # the template a rank fills
    assert optimizer["param_groups"][0]["lr"] == 0.1
    torch.testing.assert_close(optimizer["state"][0]["exp_avg"], torch.ones(2))
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
    target = newest / "model" / "__0_0.distcp"  # the shard file rank 0 wrote
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


@pytest.mark.parametrize("name", ["rng.pt", "model/.metadata"])
def test_pickle_payload_is_refused(tmp_path, name):
    """rng.pt is read with torch.load(weights_only=True); DCP's .metadata (plain pickle inside DCP)
    is unpickled first with DCP's metadata classes only."""
    path = _save(tmp_path, 1)
    bad = path / name
    if name == "rng.pt":
        torch.save({"state": _Payload()}, bad)
    else:
        bad.write_bytes(pickle.dumps(_Payload()))
    # A crafted checkpoint carries a manifest that matches its files.
    manifest = json.loads((path / "MANIFEST.json").read_text())
    import hashlib

    manifest["files"][name] = {"bytes": bad.stat().st_size, "sha256": hashlib.sha256(bad.read_bytes()).hexdigest()}
    (path / "MANIFEST.json").write_text(json.dumps(manifest))
    if os.path.exists("/tmp/raggedvl-pwned"):
        os.remove("/tmp/raggedvl-pwned")
    with pytest.raises(CheckpointError, match="refusing to load"):
        load_checkpoint(path)
    if name != "rng.pt":
        with pytest.raises(CheckpointError, match="refusing to load"):
            checkpoint_weights(path)
    assert not os.path.exists("/tmp/raggedvl-pwned")


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
        listed = json.loads((newest / "MANIFEST.json").read_text())["files"]
        assert set(checkpoint.FILES) <= set(listed) and any(name.endswith(".distcp") for name in listed)
        assert sorted(hashed) == sorted(newest / name for name in listed)


def test_ranks_verifying_together_each_hash_their_share(tmp_path, monkeypatch):
    """verify_checkpoint(part=(i, n)): the files at positions i mod n (name order) are hashed,
    every file's size is checked; the n parts together hash each file once."""
    import raggedvl.app.checkpoint as checkpoint

    path = _save(tmp_path, 1)
    listed = sorted(json.loads((path / "MANIFEST.json").read_text())["files"])
    hashed = []
    real = checkpoint._sha256
    monkeypatch.setattr(checkpoint, "_sha256", lambda p: hashed.append(Path(p)) or real(p))
    shares = []
    for i in range(3):
        hashed.clear()
        checkpoint.verify_checkpoint(path, part=(i, 3))
        shares.append(sorted(p.relative_to(path).as_posix() for p in hashed))
    assert shares == [listed[i::3] for i in range(3)]

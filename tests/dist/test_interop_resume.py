"""A FSDP2 run from colpali-engine's LoRA adapter (2 gloo processes, the real training loop):
its checkpoints hold only the adapters and the head (the frozen base stays in the colpali
checkpoint it names), and resuming from one gives the losses of the uninterrupted run.

The resumed run reads sharded state dicts that lack every frozen base tensor into the sharded
model (``parallel.wrap.load_sharded_state_dicts``, non-strict for frozen tensors only), so this
is the check that nothing trainable is left out and that the optimizer state lines up.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.dist.harness import run_distributed
from tests.dist.test_fsdp2_trainer import write_synthetic_manifest

pytestmark = [pytest.mark.dist, pytest.mark.slow]


def _straight_then_resumed(rank: int, world_size: int, data: str, cache: str, out: str) -> dict:
    from raggedvl.app.checkpoint import checkpoint_weights
    from raggedvl.parallel.runtime import init_distributed
    from raggedvl.parallel import barrier
    from raggedvl.app.config import TrainConfig
    from raggedvl.app.loop import Trainer
    from tests.models.interop.helpers import LORA
    from tests.train.test_interop_runs import resume_copy

    info = init_distributed()  # reuses the harness's gloo group
    common = dict(model=str(LORA), dataset=data, max_train_samples=None, max_eval_samples=None, max_pixels=50_176,
                  global_batch_size=4, max_steps=4, warmup_steps=1, checkpoint_every=2, eval_before=False,
                  eval_after=False, strategy="fsdp2", data_cache=cache)
    Trainer(TrainConfig(output_dir=f"{out}/straight", **common), info).run()
    if rank == 0:
        resume_copy(Path(out, "straight"), Path(out, "resumed"), step=2)
    barrier()
    Trainer(TrainConfig(output_dir=f"{out}/resumed", resume=True, **common), info).run()
    if rank != 0:
        return {}
    result = {}
    for name in ("straight", "resumed"):
        records = [json.loads(line) for line in Path(out, name, "metrics.jsonl").read_text().splitlines()]
        result[name] = {r["step"]: r["loss"] for r in records if r.get("event") == "train"}
    result["saved"] = sorted(checkpoint_weights(f"{out}/resumed/checkpoints/step-000002"))
    return result


def test_fsdp2_run_from_a_colpali_adapter_resumes_from_its_adapter_only_checkpoint(tmp_path):
    data = write_synthetic_manifest(tmp_path / "data", n_train=12, n_dev=3)
    r0 = run_distributed(_straight_then_resumed, 2, str(data), str(tmp_path / "cache"), str(tmp_path / "runs"),
                         timeout=900)[0]
    assert r0["saved"] and all("lora_" in k or k.startswith("head.") for k in r0["saved"])  # no frozen base
    assert sorted(r0["straight"]) == sorted(r0["resumed"]) == [1, 2, 3, 4]
    assert r0["resumed"] == pytest.approx(r0["straight"], rel=1e-6, abs=1e-7)

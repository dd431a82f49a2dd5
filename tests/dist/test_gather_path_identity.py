"""The gather path changes nothing (issue 18): one process with global batch 16 and two gloo
processes with 8 each give the same per-step losses for 20 steps of ``Trainer.run`` from the
colpali-engine checkpoint ``tests/fixtures/colqwen2-tiny/colqwen2_full``.

Both runs see the same global batches (the sampler's permutation depends on the seed and epoch,
not on the world size; ``sampler="equal"`` gives each of the two ranks 8 samples, as
colpali-engine's per-device batches do). With two ranks the documents are all-gathered with
gradient inside the late-interaction loss, each rank scores its own 8 queries against the 16
documents, and DDP averages the gradients; with one rank everything is local. The losses are
compared step by step: a defect of the cross-rank loss (positives shifted, a missing term, a
gradient that does not cross ranks) changes the step-1 loss or the first updates, and with them
the losses of steps 2-5 far beyond 1e-6 (each step moves the loss by 1e-2 to 1e-1). Float32
rounding (padding to each rank's longest row, the all-reduce order) starts near 1e-8 relative and
is amplified by every update of this sharp recipe (temperature 0.02, Adam): measured 1e-7 at step
5 and 1e-5 to 2e-4 by steps 13-18 depending on the CPU's kernels. So the first EXACT_STEPS steps
are held to 1e-6 and the rest to 2e-3, both far below what a defect moves. The recipe is issue 18's
(lr 5e-4 for backbone and head, 3 warm-up steps, clipping 1.0, temperature 0.02), at small
pages (max_pixels 25,088) so the 2 x 20 steps take seconds.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.dist.harness import run_distributed
from tests.dist.test_fsdp2_trainer import write_synthetic_manifest

pytestmark = pytest.mark.dist

CHECKPOINT = Path(__file__).resolve().parents[1] / "fixtures" / "colqwen2-tiny" / "colqwen2_full"
STEPS = 20
GLOBAL_BATCH = 16
EXACT_STEPS = 5  # steps before float32 rounding has been amplified past 1e-6 (module docstring)


def _losses(rank: int, world_size: int, data: str, out: str) -> list[float]:
    from raggedvl.parallel.runtime import init_distributed
    from raggedvl.train.config import TrainConfig
    from raggedvl.train.loop import Trainer

    info = init_distributed()  # reuses the harness's gloo group
    cfg = TrainConfig(
        model=str(CHECKPOINT), lora=False, dataset=data, max_train_samples=None, max_eval_samples=None,
        max_pixels=25_088, global_batch_size=GLOBAL_BATCH, sampler="equal", max_steps=STEPS, lr=5e-4, head_lr=5e-4,
        warmup_steps=3, weight_decay=0.0, max_grad_norm=1.0, temperature=0.02, precision="fp32",
        eval_before=False, eval_after=False, checkpoint_every=10**6, output_dir=out,
    )
    trainer = Trainer(cfg, info)
    losses = []
    batches = trainer.batch_stream()
    while trainer.step < trainer.total_steps:
        losses.append(trainer.train_step(next(batches)).loss)
        trainer.step += 1
    return losses


def test_one_process_of_16_equals_two_processes_of_8(tmp_path):
    data = write_synthetic_manifest(tmp_path / "data", n_train=48, n_dev=4)
    one = run_distributed(_losses, 1, str(data), str(tmp_path / "w1"), timeout=600)[0]
    two = run_distributed(_losses, 2, str(data), str(tmp_path / "w2"), timeout=600)
    assert two[0] == two[1]  # the logged loss is the all-reduced global loss on every rank
    assert len(one) == len(two[0]) == STEPS
    assert all(math.isfinite(x) for x in one)
    # the run moves away from its starting loss, so agreement is not agreement of constants
    assert max(one) - min(one) > 1e-2, one
    for step, (a, b) in enumerate(zip(one, two[0]), start=1):
        rel = 1e-6 if step <= EXACT_STEPS else 2e-3
        assert b == pytest.approx(a, rel=rel, abs=rel), (step, one, two[0])

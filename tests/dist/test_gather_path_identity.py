"""The gather path changes nothing: one process with global batch 16 and two gloo processes with 8
each take the same step from the same weights, for each of 20 steps of ``Trainer.train_step``
from the colpali-engine checkpoint ``tests/fixtures/colqwen2-tiny/colqwen2_full``.

Both runs see the same global batches (the sampler's permutation depends on the seed and epoch,
not on the world size; ``sampler="equal"`` gives each of the two ranks 8 samples, as
colpali-engine's per-device batches do). With two ranks the documents are all-gathered with
gradient inside the late-interaction loss, each rank scores its own 8 queries against the 16
documents, and DDP averages the gradients; with one rank everything is local.

Error model. Comparing two free-running float32 trajectories would test the CPU: rounding
(padding to each rank's longest row, the all-reduce order) starts near 1e-8 relative and every
Adam update of this sharp recipe amplifies it, by an amount that depends on the machine's
kernels. So the two-process run records its weights and optimizer state before every step, and
the one-process run starts each step from exactly those: step k's loss and gradient norm then
differ only by one forward and backward's rounding in a different summation order, a few float32
ulps per operation through a two-layer model, far below 1e-5 relative, on any CPU. A defect of
the cross-rank loss (positives shifted, a missing term, a gradient that does not cross ranks)
moves the loss or the gradient norm of every step by 1e-2 or more. The recipe: lr 5e-4 for
backbone and head, 3 warm-up steps, clipping 1.0, temperature 0.02, small pages (max_pixels
25,088) so the 2 x 20 steps take seconds.
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
REL = 1e-5  # one step's float32 rounding from identical weights (module docstring)


def _steps(rank: int, world_size: int, data: str, out: str, states: str, replay: bool) -> list[tuple[float, float]]:
    """(loss, gradient norm) of every step. ``replay=False``: record the weights and optimizer
    state before each step under ``states``; ``replay=True``: load them before each step."""
    import torch

    from raggedvl.parallel import unwrap_model
    from raggedvl.parallel.runtime import init_distributed
    from raggedvl.app.config import TrainConfig
    from raggedvl.app.loop import Trainer

    info = init_distributed()  # reuses the harness's gloo group
    cfg = TrainConfig(
        model=str(CHECKPOINT), lora=False, dataset=data, max_train_samples=None, max_eval_samples=None,
        max_pixels=25_088, global_batch_size=GLOBAL_BATCH, sampler="equal", max_steps=STEPS, lr=5e-4, head_lr=5e-4,
        warmup_steps=3, weight_decay=0.0, max_grad_norm=1.0, temperature=0.02, precision="fp32",
        eval_before=False, eval_after=False, checkpoint_every=10**6, output_dir=out,
    )
    trainer = Trainer(cfg, info)
    model, results = unwrap_model(trainer.model), []
    batches = trainer.batch_stream()
    while trainer.step < trainer.total_steps:
        path = Path(states) / f"before-{trainer.step}.pt"
        if replay:
            state = torch.load(path, weights_only=True)
            model.load_state_dict(state["model"])
            trainer.optimizer.load_state_dict(state["optimizer"])
        elif rank == 0:
            torch.save({"model": model.state_dict(), "optimizer": trainer.optimizer.state_dict()}, path)
        r = trainer.train_step(next(batches))
        results.append((r.loss, r.grad_norm))
        trainer.step += 1
    return results


def test_one_process_of_16_takes_the_step_of_two_processes_of_8(tmp_path):
    data = write_synthetic_manifest(tmp_path / "data", n_train=48, n_dev=4)
    states = tmp_path / "states"
    states.mkdir()
    two = run_distributed(_steps, 2, str(data), str(tmp_path / "w2"), str(states), False, timeout=600)
    one = run_distributed(_steps, 1, str(data), str(tmp_path / "w1"), str(states), True, timeout=600)[0]
    assert [x[0] for x in two[0]] == [x[0] for x in two[1]]  # the logged loss is the all-reduced global loss
    assert len(one) == len(two[0]) == STEPS
    assert all(math.isfinite(x) for pair in one for x in pair)
    losses = [x[0] for x in one]
    # the run moves away from its starting loss, so agreement is not agreement of constants
    assert max(losses) - min(losses) > 1e-2, losses
    worst = max(max(abs(a - b) / abs(b) for a, b in zip(x, y)) for x, y in zip(one, two[0]))
    print(f"largest relative difference of a step's loss or gradient norm: {worst:.2e}")
    for step, ((loss1, norm1), (loss2, norm2)) in enumerate(zip(one, two[0]), start=1):
        assert loss1 == pytest.approx(loss2, rel=REL), (step, one, two[0])
        assert norm1 == pytest.approx(norm2, rel=REL), (step, one, two[0])

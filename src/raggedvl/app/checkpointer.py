"""The checkpoints of a ``raggedvl train`` run: the periodic save (synchronous, or one at a time
in the background with ``--async-checkpoint``), the ``--save-best`` copy and ``--resume``.

The training loop decides when and hands over a :class:`TrainingState` (what a checkpoint saves
and a resume fills); the on-disk format is ``raggedvl.app.checkpoint``'s. Collectives: save,
finish_pending, save_best and resume are called by every rank (DCP's and ``all_gather_objects``),
and so is the constructor with ``--async-checkpoint`` (it creates the writes' process group);
rank 0 prints the lines. Errors: ``CheckpointError`` on every rank alike (no room on the disk,
non-finite weights, a failed write, no checkpoint that verifies for a resume)."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from raggedvl.parallel import (
    DistInfo,
    all_gather_floats,
    all_gather_objects,
    barrier,
    checkpoint_group,
    load_full_state_dicts,
    load_sharded_state_dicts,
    read_sharded,
    sharded_state_dicts,
    unwrap_model,
)
from raggedvl.rng import capture_rng_state, restore_rng_state
from raggedvl.app.checkpoint import (
    SHARDED,
    CheckpointContents,
    CheckpointError,
    PendingCheckpoint,
    check_free_space,
    finish_checkpoint,
    is_sharded,
    list_checkpoints,
    load_latest_checkpoint,
    load_older_state,
    remove_stale_temporaries,
    start_checkpoint,
)
from raggedvl.app.config import TrainConfig
from raggedvl.app.dev_evaluation import DevEvaluation
from raggedvl.app.interrupts import sigint_after_block
from raggedvl.app.resume import check_resume_settings
from raggedvl.app.run_log import RunLog
from raggedvl.app.lr_schedule import load_scheduler_state


@dataclass
class TrainingState:
    """What a checkpoint saves and a resume fills: the trainer's live objects and its position."""

    model: torch.nn.Module  # the wrapped model (DDP / FSDP2)
    optimizer: torch.optim.Optimizer
    scheduler: Any  # torch.optim.lr_scheduler.LRScheduler
    sampler: Any  # raggedvl.sampling.BalancedDistributedBatchSampler
    processor: Any  # saved beside the weights (export, eval, --model)
    step: int  # optimizer steps done
    epoch: int
    sampler_position: tuple[int, int]  # (epoch, steps of it consumed) after the last trained batch


@dataclass(frozen=True)
class ResumePoint:
    """Where a resumed run continues: the checkpoint's step, epoch and sampler position, and the
    number of processes that wrote it."""

    step: int
    epoch: int
    sampler_position: tuple[int, int]
    world_size: int


def _checkpoint_estimate(model: torch.nn.Module) -> int:
    """Bytes a checkpoint of ``model`` writes at most: every weight in float32 plus AdamW's two
    float32 moments of each trainable one."""
    return sum(p.numel() * 4 * (3 if p.requires_grad else 1) for p in model.parameters())


def _weights_finite(model: torch.nn.Module) -> torch.Tensor:
    """``[1.0]`` when every weight this rank holds (its shards under FSDP2) is finite, else ``[0.0]``
    (float64, on the weights' device; no host sync)."""
    local = [p.detach().to_local() if hasattr(p, "to_local") else p.detach() for p in model.parameters()]
    return torch.stack([torch.isfinite(t).all() for t in local]).all().to(torch.float64).reshape(1)


class Checkpointer:
    """The checkpoints of one run under ``<run_dir>/checkpoints`` (module docstring). On rank 0
    the constructor removes the unfinished checkpoints of killed writers; with
    ``--async-checkpoint`` it creates the process group the background writes use (collective)."""

    def __init__(self, cfg: TrainConfig, info: DistInfo, run_dir: Path) -> None:
        self.cfg, self.info = cfg, info
        self.run_dir = run_dir
        self.ckpt_dir = run_dir / "checkpoints"
        self.saved_step: int | None = None  # the step of the newest checkpoint this process wrote
        self.pending: PendingCheckpoint | None = None  # --async-checkpoint: the save being written
        self.group = checkpoint_group() if cfg.async_checkpoint else None  # the background writes' collectives
        for stale in remove_stale_temporaries(self.ckpt_dir) if info.is_main else ():
            print(f"removed {stale}: an unfinished checkpoint of an earlier process", file=sys.stderr, flush=True)

    def _say(self, msg: str) -> None:
        if self.info.is_main:
            tqdm.write(msg)

    def newest(self) -> Path | None:
        """The newest complete checkpoint of the run, or None."""
        found = list_checkpoints(self.ckpt_dir)
        return found[0] if found else None

    def save(self, state: TrainingState, root: Path | None = None, keep: int | None = None) -> None:
        """A sharded checkpoint of ``state`` under ``root`` (default: the run's checkpoints/):
        every rank writes its own shards of the weights and the optimizer state, nothing is
        gathered. Collective. Raises ``CheckpointError`` on every rank, writing nothing, when the
        disk cannot hold it, any weight is NaN or infinite, or the write fails on any rank. With
        ``--async-checkpoint`` (saves into the run's checkpoints/) the previous background save
        is completed first, then the shards are copied to host memory and written in the
        background (:meth:`finish_pending`). A Ctrl-C during the save is acted on once it is
        written (``raggedvl.app.interrupts.sigint_after_block``)."""
        with sigint_after_block():
            self._save(state, root, keep)

    def _save(self, state: TrainingState, root: Path | None, keep: int | None) -> None:
        self.finish_pending()
        problem = None
        if self.info.is_main:  # rank 0 writes: its disk decides, every rank raises alike
            try:
                check_free_space(root or self.ckpt_dir, state.step, _checkpoint_estimate(state.model))
            except CheckpointError as exc:
                problem = str(exc)
        problem = all_gather_objects(problem)[0]
        if problem is not None:
            raise CheckpointError(problem)
        if not all(row[0] == 1.0 for row in all_gather_floats(_weights_finite(state.model))):
            raise CheckpointError(f"the weights of step {state.step} are not finite (NaN or inf): not saved, so the "
                                  "last checkpoint stays the newest; lower --lr or raise --temperature")
        model_sd, optim_sd = sharded_state_dicts(state.model, state.optimizer)
        retriever = unwrap_model(state.model)
        if root is None:
            self.saved_step = state.step
        rng = all_gather_objects(capture_rng_state())

        def settings_and_processor(folder: Path) -> None:  # for export, eval and --model
            retriever.save_settings(folder)
            state.processor.save_pretrained(folder)

        contents = CheckpointContents(
            model_state=retriever.weights_to_save(model_sd),  # LoRA on a named base: adapters + head
            optimizer_state=optim_sd,
            rng_states=rng,
            trainer_state={
                "step": state.step,
                "epoch": state.epoch,
                "world_size": self.info.world_size,
                "sampler": {**state.sampler.state_dict(step=state.sampler_position[1]),
                            "epoch": state.sampler_position[0]},
                "scheduler": state.scheduler.state_dict(),
                "config": self.cfg.to_dict(),
            },
            extra_files=settings_and_processor,
        )
        background = root is None and self.cfg.async_checkpoint
        pending = start_checkpoint(root or self.ckpt_dir, state.step, contents, keep=keep or self.cfg.keep_checkpoints,
                                   background=(self.group, self.info.device.type == "cuda") if background else None)
        if background:
            self.pending = pending
        else:
            finish_checkpoint(pending)

    def finish_pending(self) -> None:
        """Complete the background save in flight, if any (each rank waits for its write and
        hashes its files; rank 0 writes the manifest and renames the folder into place).
        Collective. Raises ``CheckpointError`` on every rank, naming the save's step, when it
        failed on any rank."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        try:
            finish_checkpoint(pending)
        except CheckpointError as exc:
            raise CheckpointError(f"the background checkpoint of step {pending.step} failed: {exc}") from exc

    def save_best(self, state: TrainingState, evaluation: DevEvaluation, log: RunLog) -> None:
        """With ``--save-best METRIC``: evaluate the dev benchmark and, when METRIC beats every
        earlier evaluation of this run (ties keep the earlier one), replace ``<output_dir>/best``
        with a checkpoint of this step; ``best/best.json`` holds the step and the dev metrics;
        ``log`` gets the ``eval_best`` record. Collective (the evaluation is sharded)."""
        metric = self.cfg.save_best
        dev = evaluation.evaluate(state.model)["dev"]
        best_file = self.run_dir / "best" / "best.json"
        previous = json.loads(best_file.read_text())["value"] if best_file.is_file() else None
        value = dev[metric]
        log.write({"event": "eval_best", "step": state.step, f"dev/{metric}": value}, {f"dev/{metric}": value})
        if previous is not None and not value > previous:
            self._say(f"step {state.step}: dev {metric} {value:.4f} (best {previous:.4f})")
            return
        self.save(state, self.run_dir / "best", keep=1)
        if self.info.is_main:
            record = {"metric": metric, "value": value, "step": state.step, "dev": dev}
            best_file.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
            self._say(f"step {state.step}: dev {metric} {value:.4f}: new best, saved to {best_file.parent}")
        barrier()

    def resume(self, state: TrainingState, *, checked: bool = False) -> ResumePoint | None:
        """Fill ``state`` from the newest checkpoint that verifies (the ranks hash it together):
        each rank reads its own shards of the weights and the optimizer state (resharded when the
        checkpoint was written by another number of processes), the scheduler (continued over
        another total, ``raggedvl.app.lr_schedule``), the sampler position and its RNG state.
        Collective. ``checked``: the launcher checked the settings and printed the line on another
        number of processes (``raggedvl.app.resume.check_resume_settings``), so rank 0 does not
        print it again. Returns where the run continues, or None when there is no checkpoint;
        raises ``CheckpointError`` when none of them verifies."""
        ckpt, problems = load_latest_checkpoint(self.ckpt_dir, shared=True)
        for p in problems:
            self._say(f"warning: skipped checkpoint: {p}")
        if ckpt is None:
            if problems:
                raise CheckpointError(f"--resume: no valid checkpoint in {self.ckpt_dir}: " + "; ".join(problems))
            self._say(f"--resume: no checkpoint in {self.ckpt_dir}; starting from scratch")
            return None
        # the launcher's pre-flight check, again for ranks that torchrun started directly (same verdict on every rank)
        note = check_resume_settings(self.cfg, self.info.world_size, ckpt.path, ckpt.state)
        if is_sharded(ckpt.path):
            model_sd, optim_sd = sharded_state_dicts(state.model, state.optimizer)  # this rank's shards: the template
            model_sd = unwrap_model(state.model).weights_to_save(model_sd)
            for name, sd in zip(SHARDED, (model_sd, optim_sd)):
                read_sharded(ckpt.path / name, sd)
            load_sharded_state_dicts(state.model, state.optimizer, model_sd, optim_sd)
        else:  # the single-file layout: every rank reads the whole state
            load_full_state_dicts(state.model, state.optimizer, *load_older_state(ckpt.path))
        schedule_note = load_scheduler_state(state.scheduler, ckpt.state["scheduler"])
        state.sampler.load_state_dict(ckpt.state["sampler"])  # on another world size: the same global batches
        restore_rng_state(ckpt.rng[self.info.rank % len(ckpt.rng)])  # a rank the checkpoint lacks: a saved one's
        point = ResumePoint(step=ckpt.state["step"], epoch=ckpt.state["epoch"],
                            sampler_position=(ckpt.state["sampler"]["epoch"], state.sampler.state_dict()["step"]),
                            world_size=ckpt.state.get("world_size", self.info.world_size))
        if note and not checked:
            self._say(note)
        if schedule_note:
            self._say(f"--resume: {ckpt.path}: {schedule_note}")
        self._say(f"resumed from {ckpt.path} at step {point.step}")
        return point

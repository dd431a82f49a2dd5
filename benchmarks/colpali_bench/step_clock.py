"""The per-step clock of an HF ``Trainer`` run (colpali-engine's and sentence-transformers' training
paths alike): the global-batch loss and the wall-clock time at each step's end."""

from __future__ import annotations

import time

import torch
from transformers import TrainerCallback


class StepClock(TrainerCallback):
    """Records, at each step's end, the wall-clock time and the global-batch loss: ``loss.last``
    (the step's last loss, detached, of the calling rank) all-reduced and averaged over ranks (one
    extra all-reduce of one float per step; equal per-rank batches make that the global mean),
    with ``loss.doc_cosine`` beside it. With ``stop_after`` training ends after that many steps
    (the learning-rate schedule still spans the run's ``max_steps``)."""

    def __init__(self, loss: torch.nn.Module, stop_after: int | None = None) -> None:
        self.loss = loss
        self.stop_after = stop_after
        self.loop_begin = None
        self.steps: list[dict] = []

    def on_train_begin(self, args, state, control, **kwargs):
        self.loop_begin = time.time()

    def on_step_end(self, args, state, control, **kwargs):
        value = self.loss.last.to(torch.float64).reshape(1).clone()
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(value)
            value /= torch.distributed.get_world_size()
        self.steps.append({"step": state.global_step, "t": time.time(), "loss": float(value),
                           "doc_cosine": self.loss.doc_cosine})
        if self.stop_after and state.global_step >= self.stop_after:
            control.should_training_stop = True  # the schedule still spans the spec's steps

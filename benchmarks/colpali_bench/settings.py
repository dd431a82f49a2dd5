"""The settings both libraries are given for one run (one side of one comparison)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
_FIXTURE = Path("shared") / "interop" / "colqwen2-tiny" / "colqwen2_full"
# The learning-rate decay after the warm-up, on every side: the HF Trainer's ``lr_scheduler_type``
# (colpali-engine, sentence-transformers) and ``raggedvl train --lr-schedule`` (whose default differs).
LR_SCHEDULE = "linear"
# LoRA dropout of the LoRA runs on every side: colpali-engine's ColQwen2 recipe and raggedvl's default.
LORA_DROPOUT = 0.1


def default_model() -> str:
    """A tiny ColQwen2 saved by colpali-engine 0.3.18: ``shared/interop`` beside the repository
    (or beside a folder above it, for a git worktree), else the same files vendored in the
    repository (``tests/fixtures/colqwen2-tiny``)."""
    for folder in REPO.parents:
        if (folder / _FIXTURE / "config.json").is_file():
            return str(folder / _FIXTURE)
    return str(REPO / "tests" / "fixtures" / "colqwen2-tiny" / "colqwen2_full")


@dataclass(frozen=True)
class RunSettings:
    """One training run's settings, identical for colpali-engine and raggedvl.

    ``per_device_batch`` samples per process per step; ``global_batch = per_device_batch * nproc``
    (the in-batch negatives pool). Learning rates are AdamW peaks; ``head_lr`` None = ``lr``.
    ``lora_r`` None: full fine-tuning; else LoRA of this rank (alpha = r, dropout ``LORA_DROPOUT``)
    on the language model's projections, the vision tower frozen: ColQwen2's recipe
    (colpali-engine's ``train_colqwen2_model.yaml``, raggedvl's ``--lora``).
    """

    workload: str
    model: str
    nproc: int
    per_device_batch: int
    steps: int
    lr: float
    head_lr: float | None
    warmup_steps: int
    weight_decay: float
    max_grad_norm: float
    temperature: float
    max_pixels: int
    seed: int
    lora_r: int | None = None

    def __post_init__(self) -> None:
        if self.lora_r is not None and self.lora_r < 1:
            raise ValueError(f"lora_r must be >= 1 or None, got {self.lora_r}")
        for name in ("nproc", "per_device_batch", "steps", "max_pixels"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.steps < 3:
            raise ValueError(f"steps must be >= 3 (samples/s is measured over steps 3..N), got {self.steps}")
        if self.warmup_steps < 0 or self.weight_decay < 0 or self.max_grad_norm < 0:
            raise ValueError("warmup_steps, weight_decay and max_grad_norm must be >= 0")
        if self.lr <= 0 or self.temperature <= 0 or (self.head_lr is not None and self.head_lr <= 0):
            raise ValueError(f"lr, head_lr and temperature must be > 0, got {self.lr}, {self.head_lr}, {self.temperature}")

    @property
    def global_batch(self) -> int:
        return self.per_device_batch * self.nproc

    @property
    def label(self) -> str:
        tuning = f", LoRA r{self.lora_r}" if self.lora_r else ""
        return f"{self.workload}, {self.nproc} proc x {self.per_device_batch}{tuning}"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

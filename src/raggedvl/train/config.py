"""Typed configuration of ``raggedvl train`` (validated at construction).

The defaults are the embedded default job: the tiny preset on the rdocs pairs with the
recipe of ``raggedvl.models.TINY_TRAINING_DEFAULTS`` (init std 0.1, lr 2e-4 for the backbone
and 2e-3 for the head, 600 steps, global batch 8, temperature 0.02, 100,352 pixels per page;
see that module and benchmarks/results/tiny_recipe.md for why). For a pretrained checkpoint start from
``configs/qwen2-vl-2b.yaml`` (ColPali's recipe: LoRA r=32, lr 5e-5, global batch 32).

Precedence: dataclass defaults (the embedded default job) < YAML file (``--config``) <
command-line flags. Every field is a flag: ``global_batch_size`` is ``--global-batch-size``.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


@dataclass
class TrainConfig:
    # model
    model: str = "tiny"  # "tiny" (built from a config, no download) | hub id | local directory
    head: str = "late_interaction"  # "late_interaction" (ColQwen-style multi-vector) | "bi_encoder"
    pooling: str = "last"  # bi-encoder pooling: "last" | "mean"
    dim: int = 128  # embedding dimension of the projection head
    lora: bool | None = None  # None: LoRA for pretrained checkpoints, full training for "tiny"
    lora_r: int = 32
    lora_alpha: int = 32
    lora_dropout: float = 0.1
    gradient_checkpointing: bool = False
    attn_implementation: str | None = None  # None: sdpa; "flash_attention_2" when installed
    # data
    dataset: str = "rdocs"  # "rdocs" (embedded) | hub id | local parquet / image folder
    train_split: str = "train"
    eval_split: str = "dev"
    max_train_samples: int | None = 256  # rdocs: pairs built and used (None: all ~1,300)
    max_eval_samples: int | None = 128
    min_pixels: int | None = None  # None: the processor's default for the model
    max_pixels: int | None = None  # None: 100,352 for "tiny" (the recipe), else the checkpoint's
    max_length: int | None = None  # token cap per sample (never cuts through image placeholders)
    on_bad_image: str = "error"  # "error" | "skip" (skips are counted in the run summary)
    # objective
    loss: str = "late_interaction"  # "late_interaction" | "pairwise" | "infonce" (bi-encoder)
    temperature: float = 0.02  # logits = score / temperature
    # optimisation
    global_batch_size: int = 8  # G: samples per optimizer step over all ranks (the negatives pool)
    epochs: int = 1
    max_steps: int | None = 600  # overrides epochs when set (none: train `epochs` epochs)
    lr: float = 2e-4  # AdamW peak learning rate of the backbone (warmup, then cosine decay)
    head_lr: float | None = 2e-3  # of the projection head (none: same as lr)
    weight_decay: float = 0.0
    warmup_steps: int = 10
    max_grad_norm: float = 1.0
    sampler: str = "balanced"  # "balanced" (cost-balanced ranks) | "equal" (equal sample counts)
    seed: int = 0
    precision: str = "auto"  # "auto" (bf16 autocast on CUDA, fp32 on CPU) | "bf16" (also on CPU) | "fp32"
    strategy: str = "ddp"  # "ddp" | "fsdp2"
    grad_cache: bool = False
    grad_cache_budget: int = 4096  # GradCache chunk budget, in patches + tokens per chunk
    # run
    output_dir: str = "runs/default"
    checkpoint_every: int = 50  # steps; a final checkpoint is always written
    keep_checkpoints: int = 2
    log_every: int = 1
    eval_before: bool = True
    eval_after: bool = True
    eval_train_samples: int = 128  # train pairs scored to show memorisation
    eval_batch_size: int = 16
    resume: bool = False  # continue from the newest valid checkpoint in output_dir
    collective_timeout_s: int = 300  # every collective fails after this many seconds
    data_cache: str | None = None  # where built datasets are cached (default ~/.cache/raggedvl)

    def __post_init__(self) -> None:
        choices = {
            "head": ("late_interaction", "bi_encoder"),
            "pooling": ("last", "mean"),
            "loss": ("late_interaction", "pairwise", "infonce"),
            "sampler": ("balanced", "equal"),
            "precision": ("auto", "bf16", "fp32"),
            "strategy": ("ddp", "fsdp2"),
            "on_bad_image": ("error", "skip"),
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r} is not one of {allowed}")
        if (self.head == "bi_encoder") != (self.loss == "infonce"):
            raise ValueError(
                f"head={self.head!r} does not go with loss={self.loss!r}: use loss='infonce' with the "
                "bi-encoder head, and 'late_interaction' or 'pairwise' with the multi-vector head"
            )
        for name in ("global_batch_size", "epochs", "dim", "checkpoint_every", "log_every", "eval_batch_size",
                     "grad_cache_budget", "keep_checkpoints", "collective_timeout_s"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"max_steps must be >= 1 (or none to train `epochs` epochs), got {self.max_steps}")
        if self.temperature <= 0 or self.lr <= 0 or (self.head_lr is not None and self.head_lr <= 0):
            raise ValueError(f"temperature, lr and head_lr must be > 0, got {self.temperature}, {self.lr}, {self.head_lr}")

    @property
    def resolved_max_pixels(self) -> int | None:
        """``max_pixels``, or the tiny recipe's 100,352 for the tiny preset when not given."""
        if self.max_pixels is None and self.model == "tiny":
            return 100_352
        return self.max_pixels

    @property
    def use_lora(self) -> bool:
        return self.lora if self.lora is not None else self.model != "tiny"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "TrainConfig":
        """Raises ``ValueError`` for an unknown key or a value of the wrong type (a quoted
        ``"false"`` is a string, not a boolean), naming the key."""
        fields = {f.name: str(f.type) for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - set(fields))
        if unknown:
            raise ValueError(f"unknown config keys {unknown}; known keys: {sorted(fields)}")
        for key, value in values.items():
            _check_type(key, value, fields[key])
        return cls(**values)

    @classmethod
    def from_yaml(cls, path: str | Path, overrides: dict[str, Any] | None = None) -> "TrainConfig":
        with open(path, encoding="utf-8") as f:
            values = yaml.safe_load(f) or {}
        if not isinstance(values, dict):
            raise ValueError(f"{path}: expected a mapping of config keys, got {type(values).__name__}")
        values.update(overrides or {})
        return cls.from_dict(values)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _check_type(key: str, value: Any, hint: str) -> None:
    if value is None:
        if "None" not in hint:
            raise ValueError(f"config key {key!r} may not be null")
        return
    if "bool" in hint:
        ok = isinstance(value, bool)
    elif "int" in hint:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif "float" in hint:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    else:
        ok = isinstance(value, str)
    if not ok:
        want = hint.replace(" | None", " or null")
        raise ValueError(f"config key {key!r} must be {want}, got {value!r} ({type(value).__name__})")


def _parse_bool(text: str) -> bool:
    low = text.lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected a boolean (true/false), got {text!r}")


def _nullable(conv):
    def parse(text: str):
        return None if text.lower() in ("none", "null") else conv(text)

    parse.__name__ = conv.__name__
    return parse


def add_config_arguments(parser) -> None:
    """Add one ``--flag`` per config field to an argparse parser (absent unless given;
    ``none`` sets an optional field to None)."""
    import argparse

    hints = {f.name: f.type for f in dataclasses.fields(TrainConfig)}
    for f in dataclasses.fields(TrainConfig):
        hint = str(hints[f.name])
        if "bool" in hint:
            conv = _parse_bool
        elif "int" in hint:
            conv = int
        elif "float" in hint:
            conv = float
        else:
            conv = str
        if "None" in hint:
            conv = _nullable(conv)
        parser.add_argument(
            "--" + f.name.replace("_", "-"), dest=f.name, type=conv, default=argparse.SUPPRESS, metavar=f.name.upper(),
            help=f"(default: {f.default!r})",
        )


def config_from_args(args) -> TrainConfig:
    """Defaults < ``--config`` YAML < flags that were given."""
    given = vars(args)
    overrides = {f.name: given[f.name] for f in dataclasses.fields(TrainConfig) if f.name in given}
    if getattr(args, "config", None):
        return TrainConfig.from_yaml(args.config, overrides)
    return TrainConfig.from_dict(overrides)

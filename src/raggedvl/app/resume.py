"""What ``raggedvl train --resume`` needs to keep from the run it continues, checked in the
launching process before any rank starts (a mismatch used to surface inside a rank, as the
sampler's or ``load_state_dict``'s error, after the model was built), and again by
``raggedvl.app.checkpointer.Checkpointer.resume`` for ranks that torchrun started directly.

A checkpoint holds weights of one shape, a sampler position in one plan and an optimizer at one
learning rate. Continuing it is exact only with the settings that produced them:

- weights: ``model``, ``head``, ``dim``, ``pooling``, whether LoRA is on, ``lora_r``, ``lora_alpha``;
- the sampler's plan: the training data (``dataset`` and ``dataset_weights``, ``batch_sampling``,
  ``source_column``, ``negatives_column``, ``positive_sampling``, ``train_split``, ``eval_fraction``,
  ``max_train_samples``, the columns, ``on_empty_query``, the image size limits), the global
  batch, ``seed``, ``sampler`` and ``max_patches_per_rank``;
- the learning rates and their schedule: ``lr`` and ``head_lr`` (the scheduler's saved base rates
  would win over new values silently), ``warmup_steps`` and ``lr_schedule`` (the checkpoint's
  warmup and decay shape continue).
- the objective the steps so far optimised: ``loss``, ``temperature`` and ``false_negatives``.

``max_steps`` / ``epochs`` may change (train longer or shorter: the steps trained and the warmup
stay as they were, and the rest of the decay is stretched from the last trained step's rate to 0
at the new total, without a jump: ``raggedvl.app.lr_schedule``; rank 0 says so in one line), as
may evaluation, logging and checkpoint settings, and the
number of processes: the sampler draws each global batch independently of the world size and
then partitions it over the ranks, so the run continues with the same global batches, and the
sharded state is resharded as it loads (``raggedvl.app.checkpoint``).
A saved config without a key (a run of an older raggedvl) counts as that key's default. A
local model or dataset path is compared resolved (a relative and an absolute spelling of one
file are the same data).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

from raggedvl.app.options import field_specs
from raggedvl.app.checkpoint import MANIFEST, list_checkpoints
from raggedvl.app.config import TrainConfig
from raggedvl.app.wording import counted
from raggedvl.suggest import closest

RESUME_KEYS = (
    "model", "head", "dim", "pooling", "lora", "lora_r", "lora_alpha",
    "dataset", "dataset_weights", "batch_sampling", "source_column",
    "negatives_column", "positive_sampling", "train_split", "eval_fraction", "max_train_samples",
    "query_column", "image_column", "on_empty_query",
    "min_pixels", "max_pixels", "global_batch_size", "seed", "sampler", "max_patches_per_rank",
    "lr", "head_lr", "warmup_steps", "lr_schedule", "loss", "temperature", "false_negatives",
)
# set by the launcher for the ranks it starts once it checked the settings and printed their line
RESUME_CHECKED_ENV = "RAGGEDVL_RESUME_CHECKED"


def resume_point(cfg: TrainConfig) -> tuple[Path, dict[str, Any]] | None:
    """(checkpoint folder, its ``trainer_state.json``) of the newest checkpoint under
    ``<output_dir>/checkpoints`` whose manifest lists that file with the same SHA-256 (the
    weights are not hashed here: the rank verifies them), or None without one. A torn newer
    checkpoint is passed over, as ``--resume`` itself does."""
    for path in list_checkpoints(Path(cfg.output_dir) / "checkpoints"):
        try:
            entry = json.loads((path / MANIFEST).read_text(encoding="utf-8"))["files"]["trainer_state.json"]
            raw = (path / "trainer_state.json").read_bytes()
        except (OSError, ValueError, KeyError):
            continue
        if hashlib.sha256(raw).hexdigest() == entry.get("sha256"):
            return path, json.loads(raw)
    return None


def check_something_to_resume(cfg: TrainConfig, resumed: tuple[Path, dict[str, Any]] | None) -> None:
    """With ``--resume``: raise ``ValueError`` (one line) when ``output_dir`` holds no checkpoint
    (naming a sibling folder that does when ``output_dir`` does not exist: a mistyped name; a run
    folder without a checkpoint gets no suggestion) or when its newest checkpoint
    already reached ``--max-steps`` (nothing left to train)."""
    out = Path(cfg.output_dir)
    if resumed is None:
        parent = out.parent if str(out.parent) else Path(".")
        mistyped = parent.is_dir() and not out.exists()
        runs = sorted(p.name for p in parent.iterdir() if list_checkpoints(p / "checkpoints")) if mistyped else []
        close = closest(out.name, runs)
        hint = f"; did you mean {str(parent / close)!r}?" if close else ""
        raise ValueError(f"--resume: {cfg.output_dir} holds no checkpoint to resume{hint} (to start a new run there, "
                         "leave out --resume)")
    checkpoint, state = resumed
    if cfg.max_steps is not None and int(state.get("step", 0)) >= cfg.max_steps:
        raise ValueError(f"--resume: {checkpoint} is step {state['step']}, and --max-steps is {cfg.max_steps}: nothing "
                         f"left to train; pass a larger --max-steps to continue, or evaluate it with raggedvl eval "
                         f"{checkpoint}")


def _effective(values: dict[str, Any], planned_steps: int | None) -> dict[str, Any]:
    """The resume keys as the run used them: defaults for missing keys, ``lora`` and
    ``max_pixels`` resolved (none means full training / 100,352 pixels for the tiny preset),
    ``warmup_steps`` resolved for the checkpoint's run of ``planned_steps`` (when known: a
    default and a given value that are the same warmup are the same)."""
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    values = {k: v for k, v in values.items() if k in known}
    try:
        cfg = dataclasses.replace(TrainConfig(), **values)
    except (TypeError, ValueError):  # a value this version refuses: compare what was saved
        return {k: values.get(k) for k in RESUME_KEYS}
    warmup = cfg.warmup_steps if planned_steps is None else cfg.resolved_warmup_steps(planned_steps)
    return {**{k: getattr(cfg, k) for k in RESUME_KEYS}, "lora": cfg.use_lora, "max_pixels": cfg.resolved_max_pixels,
            "warmup_steps": warmup}


def _local_spelling(value: Any) -> Any:
    """A local path that exists, as its absolute resolved path (so ``data/x.parquet`` and
    ``/abs/data/x.parquet`` are the same source); lists item by item; anything else as given."""
    if isinstance(value, (list, tuple)):
        return type(value)(_local_spelling(v) for v in value)
    if isinstance(value, str) and value and Path(value).expanduser().exists():
        return str(Path(value).expanduser().resolve())
    return value


def _shown(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    return repr(value) if isinstance(value, str) else str(value)


def check_resume_settings(cfg: TrainConfig, world_size: int, checkpoint: Path, state: dict[str, Any]) -> str | None:
    """Raise ``ValueError`` (one line) naming every resume key (module docstring) whose value
    differs from the checkpoint's run, old and new value, and the two fixes. Returns the one line
    to print when the number of processes differs (allowed), else None."""
    planned = state.get("config", {}).get("max_steps")
    then, now = _effective(state.get("config", {}), planned), _effective(cfg.to_dict(), planned)
    specs = field_specs(TrainConfig)
    diffs = [f"{specs[k].flag} {_shown(then[k])} then, {_shown(now[k])} now" for k in RESUME_KEYS
             if _local_spelling(then[k]) != _local_spelling(now[k])]
    if diffs:
        raise ValueError(
            f"--resume: {checkpoint} cannot continue with these settings: {'; '.join(diffs)}. "
            "Pass the original values to continue it exactly, or start a fresh run in a new --output-dir"
        )
    saved_world = state.get("world_size")
    if saved_world is None or saved_world == world_size:
        return None
    return (f"--resume: {checkpoint} was written by {counted(saved_world, 'process', 'processes')} and continues on "
            f"{world_size}: the same "
            "global batches, partitioned over the new ranks; the sharded state is resharded as it loads")


def check_resume_data(cfg: TrainConfig, data, world_size: int, checkpoint: Path, state: dict[str, Any]) -> None:
    """After the data is open (``data``: ``raggedvl.app.setup.RunData``): the sampler this run
    would build must accept the checkpoint's sampler state (same pairs, image sizes and plan),
    else ``ValueError`` in one line; catches data that changed under the same name (a rewritten
    parquet file). No collective."""
    import torch

    from raggedvl.parallel import DistInfo
    from raggedvl.sampling import SamplerPositionError
    from raggedvl.app.setup import make_sampler, row_sources

    info = DistInfo(rank=0, world_size=world_size, local_rank=0, device=torch.device("cpu"), backend="none")
    try:
        make_sampler(cfg, data.costs, info, data.train_set.part_sizes,
                     row_sources(cfg, data.train_set)).load_state_dict(state["sampler"])
    except SamplerPositionError as exc:
        raise ValueError(f"--resume: {checkpoint}: {exc}") from exc
    except (KeyError, ValueError) as exc:
        detail = str(exc).removeprefix("sampler state does not match this sampler: ")
        raise ValueError(
            f"--resume: {checkpoint} was trained on other training data than {cfg.dataset!r} holds now ({detail}); "
            "resume with the data the run started with, or start a fresh run in a new --output-dir"
        ) from exc

"""``raggedvl eval CHECKPOINT``: retrieval metrics of a saved checkpoint beside a random ranker."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path


from raggedvl.parallel.runtime import init_distributed, shutdown
from raggedvl.parallel.wrap import load_full_state_dicts
from raggedvl.train.checkpoint import CheckpointError, list_checkpoints, load_checkpoint, verify_checkpoint
from raggedvl.train.config import TrainConfig
from raggedvl.train.evaluate import evaluate_retrieval
from raggedvl.evaluation.metrics import random_ranker_metrics
from raggedvl.train.report import format_metrics_table


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint folder as given, or the newest checkpoint of a run directory that verifies
    (a torn or corrupt newer one is reported and skipped, as ``--resume`` does).
    Raises :class:`CheckpointError` when there is none."""
    path = Path(path)
    if (path / "MANIFEST.json").exists() or (path / "model.safetensors").exists():
        return path
    found = list_checkpoints(path / "checkpoints") or list_checkpoints(path)
    if not found:
        raise CheckpointError(f"{path}: neither a checkpoint folder nor a run directory with checkpoints/step-*")
    problems = []
    for candidate in found:
        try:
            verify_checkpoint(candidate)
        except CheckpointError as exc:
            problems.append(str(exc))
            print(f"warning: skipped checkpoint: {exc}", file=sys.stderr)
            continue
        return candidate
    raise CheckpointError(f"{path}: no checkpoint verifies: " + "; ".join(problems))


def evaluate_checkpoint(path: str | Path, *, split: str | None = None, batch_size: int = 16, max_samples: int | None = None) -> dict[str, float]:
    """Load a checkpoint (verified, code-free), rebuild its model from the saved config and
    evaluate it on ``split`` (default: the run's eval split). Runs on one process or under
    torchrun (encoding is sharded over ranks). Prints a table on rank 0 and returns the metrics."""
    from raggedvl.train.setup import build_components

    ckpt = load_checkpoint(resolve_checkpoint(path))
    values = dict(ckpt.state["config"])
    if max_samples is not None:
        values["max_eval_samples"] = max_samples
    if split is not None:
        values["eval_split"] = split
    cfg = dataclasses.replace(TrainConfig.from_dict(values), resume=False, eval_train_samples=1)
    info = init_distributed(timeout_s=cfg.collective_timeout_s)
    try:
        c = build_components(cfg, info)
        model = c.model.to(info.device)
        load_full_state_dicts(model, None, ckpt.model, None)
        metrics = evaluate_retrieval(model, c.eval_set, c.collate, batch_size=batch_size, device=info.device)
        if info.is_main:
            n = int(metrics["n"])
            print(f"{ckpt.path} (step {ckpt.state['step']}), split {cfg.eval_split!r}, {n} query-document pairs")
            print(format_metrics_table({f"random ranker ({n} docs)": random_ranker_metrics(n), "checkpoint": metrics}))
            print(f"documents: mean pairwise cosine {metrics['doc_mean_cosine']:.4f}")
        return metrics
    finally:
        shutdown()

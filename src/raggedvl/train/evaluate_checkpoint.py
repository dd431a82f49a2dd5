"""``raggedvl eval CHECKPOINT``: retrieval metrics of a saved checkpoint beside a random ranker."""

from __future__ import annotations

import dataclasses
from pathlib import Path


from raggedvl.parallel.runtime import init_distributed, shutdown
from raggedvl.parallel.wrap import load_full_state_dicts
from raggedvl.train.checkpoint import load_checkpoint_or_latest
from raggedvl.train.config import TrainConfig
from raggedvl.train.evaluate import evaluate_retrieval
from raggedvl.evaluation.metrics import random_ranker_metrics
from raggedvl.train.report import format_metrics_table


def evaluate_checkpoint(path: str | Path, *, split: str | None = None, batch_size: int = 16, max_samples: int | None = None) -> dict[str, float]:
    """Load a checkpoint (verified, code-free), rebuild its model from the saved config and
    evaluate it on ``split`` (default: the run's eval split). Runs on one process or under
    torchrun (encoding is sharded over ranks). Prints a table on rank 0 and returns the metrics."""
    from raggedvl.train.setup import build_components

    ckpt = load_checkpoint_or_latest(path)
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

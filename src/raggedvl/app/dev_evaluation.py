"""The evaluations of a ``raggedvl train`` run: the training pairs scored (memorisation) and the
dev benchmark, before training (``--eval-before``), for ``--save-best`` and after training
(``--eval-after``), with their timing and records.

The scoring is the library's (``raggedvl.evaluation.evaluator.evaluate_benchmark``). Collective:
every rank calls each method with the same model; the documents and queries are sharded over the
ranks and every rank gets the same metrics. Errors: those of the library evaluator."""

from __future__ import annotations

import time
from typing import Any

import torch

from raggedvl.evaluation.evaluator import evaluate_benchmark, random_baseline
from raggedvl.parallel import DistInfo, unwrap_model
from raggedvl.app.config import TrainConfig
from raggedvl.app.run_log import RunLog
from raggedvl.app.startup import StartupClock


class DevEvaluation:
    """The run's evaluated splits, ``{"train": training pairs, "dev": dev benchmark}`` (a split
    without a benchmark is left out), scored by ``collate``'s batches under ``autocast``."""

    def __init__(self, cfg: TrainConfig, info: DistInfo, collate: Any, benchmarks: dict[str, Any],
                 autocast: Any) -> None:
        self.cfg, self.info = cfg, info
        self.collate, self.autocast = collate, autocast
        self.benchmarks = {split: bench for split, bench in benchmarks.items() if bench is not None}

    def evaluate(self, model: torch.nn.Module) -> dict[str, dict[str, float]]:
        """``{split: metrics}`` of the wrapped ``model`` (``evaluate_benchmark``'s metrics plus
        ``n``, the number of documents ranked). Encoder rebalancing (``--rebalance-vision``) is
        off meanwhile: the evaluation's shards may give the ranks different batch counts."""
        forward = unwrap_model(model) if self.cfg.strategy == "ddp" else model
        retriever = unwrap_model(model)
        rebalancer = getattr(retriever, "vision_rebalancer", None)
        if rebalancer is not None:
            retriever.set_vision_rebalancer(None)
        out = {}
        try:
            for name, bench in self.benchmarks.items():
                metrics = evaluate_benchmark(forward, self.collate, bench, batch_size=self.cfg.eval_batch_size,
                                             device=self.info.device, autocast=self.autocast)
                out[name] = {**metrics, "n": metrics["documents"]}
        finally:
            if rebalancer is not None:
                retriever.set_vision_rebalancer(rebalancer)
        return out

    def before_training(self, model: torch.nn.Module, log: RunLog, clock: StartupClock) -> dict[str, Any] | None:
        """With ``--eval-before``: :meth:`evaluate` of the initial ``model``, timed as the
        ``eval_before`` phase of ``clock`` and written to ``log``; else None. For a run
        starting at step 0."""
        if not self.cfg.eval_before:
            return None
        t0 = time.perf_counter()
        results = self.evaluate(model)
        clock.add({"eval_before": time.perf_counter() - t0})
        log.evaluation("eval_before", 0, results)
        return results

    def after_training(self, model: torch.nn.Module) -> dict[str, Any] | None:
        """With ``--eval-after``: :meth:`evaluate` of the trained ``model`` (``RunLog.finish``
        writes it); else None."""
        return self.evaluate(model) if self.cfg.eval_after else None

    def random_baselines(self) -> dict[str, dict[str, float]]:
        """Per split, the expected metrics of a uniformly random ranking (the summary's chance
        rows). No collective."""
        return {split: random_baseline(bench) for split, bench in self.benchmarks.items()}

"""Experiment trackers for ``raggedvl train --report-to``: TensorBoard, Weights & Biases, MLflow.

Each is an optional extra (``pip install 'raggedvl[tensorboard]'``, ``[wandb]``, ``[mlflow]``);
rank 0 sends every ``train`` record's numbers (``train/loss``, ``train/grad_norm``,
``lr/<group>``, ``train/samples_per_s``, ``train/patches_per_s``, ``train/peak_memory_mib``) and
the evaluations' retrieval metrics (:func:`eval_scalars`: ``dev/ndcg@5``, ``memorisation/ndcg@5``
for the training pairs scored, ...), at the optimizer step.

- tensorboard: event files in ``<output_dir>/tensorboard`` (``torch.utils.tensorboard``);
- wandb: ``wandb.init(dir=<output_dir>, name=<run name>, config=<train config>)``; the project
  is ``$WANDB_PROJECT`` or "raggedvl"; ``WANDB_MODE=offline`` keeps it on disk;
- mlflow: a run named after the output directory in the tracking URI mlflow is configured with
  (``$MLFLOW_TRACKING_URI``, default ``./mlruns``), the config as parameters.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

from raggedvl.app.options import did_you_mean

TRACKERS = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}  # name: module it needs


def parse_report_to(value: str) -> tuple[str, ...]:
    """``"none"`` -> (); ``"tensorboard,wandb"`` -> ("tensorboard", "wandb"). Raises ``ValueError``
    for an unknown name (with the closest) or ``none`` mixed with trackers."""
    names = tuple(dict.fromkeys(n.strip().lower() for n in value.split(",") if n.strip()))
    if names in ((), ("none",)):
        return ()
    for name in names:
        if name not in TRACKERS:
            raise ValueError(f"report_to: unknown tracker {name!r}{did_you_mean(name, [*TRACKERS, 'none'])} "
                             f"(one or more of {', '.join(TRACKERS)}, comma-separated, or none)")
    return names


def check_installed(names: tuple[str, ...]) -> None:
    """Raise ``ValueError`` naming the extra to install for a tracker whose package is missing."""
    for name in names:
        if importlib.util.find_spec(TRACKERS[name]) is None:
            raise ValueError(f"--report-to {name} needs the {TRACKERS[name]} package: pip install 'raggedvl[{name}]'")


EVAL_TAGS = {"train": "memorisation", "dev": "dev"}
"""Tracker tag prefix of each evaluated split (``DevEvaluation.evaluate``'s keys): the training pairs
scored show memorisation, kept apart from the ``train/`` numbers of the steps (the loss)."""
EVAL_EXTRA = ("mean_rank", "random_mean_rank")
"""Tracked besides ``raggedvl.evaluation.METRICS``: the first relevant document's mean rank and
its value for a random ranking (the chance baseline)."""


def eval_scalars(results: dict[str, dict[str, Any]]) -> dict[str, float]:
    """The tracker scalars of one evaluation (``{split: metrics}``, as ``DevEvaluation.evaluate``
    returns): per split, ``<EVAL_TAGS[split]>/<metric>`` for the retrieval metrics
    (``ndcg@k``, ``recall@k``, ``mrr@k``, ``map@k``) and ``EVAL_EXTRA``; counts (queries,
    documents), standard errors and diagnostics stay in ``metrics.jsonl``. Imports torch (the
    metric names); called by rank 0 of a run."""
    from raggedvl.evaluation.metrics import METRICS

    keep = (*METRICS, *EVAL_EXTRA)
    return {f"{EVAL_TAGS.get(split, split)}/{name}": metrics[name]
            for split, metrics in results.items() for name in keep if name in metrics}


def _flat(config: dict[str, Any]) -> dict[str, Any]:
    return {k: ("none" if v is None else v) for k, v in config.items()}


class Trackers:
    """The trackers of one run (rank 0 only); ``log`` sends numbers at a step, ``close`` ends them."""

    def __init__(self, names: tuple[str, ...], run_dir: str | Path, config: dict[str, Any], *, resume: bool = False) -> None:
        check_installed(names)
        self.run_dir = Path(run_dir)
        self._tb = self._wandb = self._mlflow = None
        if "tensorboard" in names:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))
        if "wandb" in names:
            import wandb

            self._wandb = wandb.init(project=os.environ.get("WANDB_PROJECT", "raggedvl"), dir=str(self.run_dir),
                                     name=self.run_dir.name, config=config, resume="allow" if resume else None)
        if "mlflow" in names:
            import mlflow

            self._mlflow = mlflow
            mlflow.start_run(run_name=self.run_dir.name)
            mlflow.log_params({k: str(v)[:250] for k, v in _flat(config).items()})

    def log(self, values: dict[str, float], step: int) -> None:
        """Send ``values`` (name -> number; names like ``train/loss``, ``lr/head``) at ``step``."""
        numbers = {k: float(v) for k, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self._tb is not None:
            for key, value in numbers.items():
                self._tb.add_scalar(key, value, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(numbers, step=step)
        if self._mlflow is not None:
            self._mlflow.log_metrics({k.replace("@", "_at_"): v for k, v in numbers.items()}, step=step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._mlflow is not None:
            self._mlflow.end_run()

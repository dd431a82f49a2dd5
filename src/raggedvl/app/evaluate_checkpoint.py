"""``raggedvl eval CHECKPOINT [--dataset PATH_OR_ID --split NAME]``: retrieval metrics of a saved
checkpoint on a benchmark, beside a random ranker, as a table and a results JSON."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import torch

from raggedvl import __version__
from raggedvl.data import RetrievalCollator
from raggedvl.evaluation.metrics import METRICS
from raggedvl.parallel import init_distributed, load_full_state_dicts, shutdown
from raggedvl.app.collapse import doc_cosine_warning
from raggedvl.app.checkpoint import MANIFEST, checkpoint_weights, list_checkpoints, load_checkpoint_or_latest
from raggedvl.app.config import TrainConfig
from raggedvl.app.report import format_metrics_table
from raggedvl.app.rundir import results_folder
from raggedvl.app.wording import counted


def file_slug(text: str) -> str:
    """``text`` as a file-name part: each run of characters other than letters, digits, ".", "_" and
    "-" becomes "_"; the last 80 characters."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", str(text).rstrip("/")).strip("_")[-80:] or "dataset"


def _is_training_checkpoint(path: Path) -> bool:
    """A raggedvl training checkpoint (MANIFEST.json) or a run directory holding some."""
    return (path / MANIFEST).exists() or (path / "checkpoints").is_dir() or bool(list_checkpoints(path))


def _processor_source(path: Path) -> str:
    """Where a model directory's processor comes from: the processor saved in it (its pixel
    limits are the ones training used), else, for a saved tiny retriever without one, the tiny
    preset's."""
    from raggedvl.models.saved import is_saved_retriever, read_retriever_meta
    from raggedvl.app.sources import PROCESSOR_FILES

    if any((path / name).is_file() for name in PROCESSOR_FILES):
        return str(path)
    if is_saved_retriever(path) and read_retriever_meta(path)[0]["retriever"].get("source") == "tiny":
        return "tiny"
    return str(path)


def load_model(path: Path, device: torch.device | str) -> tuple[torch.nn.Module, Any, TrainConfig | None, dict[str, Any]]:
    """(model on ``device``, processor, the run's config or None, model description) for a
    raggedvl checkpoint / run directory, or any retriever ``build_retriever`` loads."""
    from raggedvl.data import build_processor
    from raggedvl.models import build_retriever

    if not _is_training_checkpoint(path):
        processor = build_processor(_processor_source(path))
        model = build_retriever(str(path), processor=processor)
        return model.to(device), processor, None, {"path": str(path.resolve())}
    ckpt = load_checkpoint_or_latest(path)
    model, processor, cfg = rebuild_retriever(ckpt.state["config"], checkpoint_weights(ckpt.path))
    return model.to(device), processor, cfg, {"path": str(ckpt.path.resolve()), "step": ckpt.state["step"], "model": cfg.model,
                                                   "head": cfg.head}


def rebuild_retriever(config: dict[str, Any], weights: dict[str, torch.Tensor]) -> tuple[torch.nn.Module, Any, TrainConfig]:
    """(retriever on the CPU, processor, config) of a training run: built from the run's saved
    ``config`` (``trainer_state.json``'s) as training built it, then loaded with ``weights`` (the
    checkpoint's state dict). Works for checkpoints written before they held the retriever's
    settings; the prompts are the model's defaults with the run's ``query_prefix`` /
    ``padding_side``. Raises ``ValueError`` for an unknown config key, ``RuntimeError`` for weights
    of another shape."""
    from raggedvl.app.setup import build_cfg_processor, build_model

    cfg = dataclasses.replace(TrainConfig.from_dict(dict(config)), resume=False)
    processor = build_cfg_processor(cfg)
    model = build_model(cfg, processor)
    load_full_state_dicts(model, None, weights, None)
    return model, processor, cfg


def checkpoint_collator(model: torch.nn.Module, processor: Any, cfg: TrainConfig | None, *,
                        on_bad_image: str = "error") -> RetrievalCollator:
    """The collator writing inputs as ``model`` was trained: its prompts and family, and the
    run's ``max_length`` (``cfg`` of :func:`load_model`; None: no cap)."""
    return RetrievalCollator(processor, max_length=cfg.max_length if cfg is not None else None, on_bad_image=on_bad_image,
                             prompts=model.config.prompts, layout=model.family.name)


def evaluate_checkpoint(path: str | Path, *, dataset: str | None = None, split: str | None = None, batch_size: int = 16,
                        max_samples: int | None = None, output: str | Path | None = None,
                        on_bad_image: str = "error", query_column: str | None = None, image_column: str | None = None,
                        id_column: str | None = None) -> dict[str, Any]:
    """Evaluate a checkpoint on a benchmark and write a results JSON.

    ``path``: a raggedvl checkpoint or run directory (newest checkpoint that verifies), or any
    model directory ``build_retriever`` loads. ``dataset``: a benchmark (pairs or BEIR layout,
    local or hub; see ``raggedvl.evaluation.benchmark.load_benchmark``); default: the run's own
    evaluation split (with the run's overlap check). ``split`` default: the run's eval split, else
    the dataset's one split, else "test". Runs on one process or under torchrun (queries and
    documents sharded over ranks).
    Rank 0 prints a table and writes ``output`` (default ``<run>/eval/<dataset>-<split>.json``
    for a run, else ``<model folder>/eval/<dataset>-<split>.json``). ``query_column`` / ``image_column`` /
    ``id_column``: the pairs' columns (None: with ``dataset``, ``query`` / ``image`` / row ids;
    without, the run's ``eval_*_column``; an ``id_column`` of ``""``: no id column, row ids). Returns the results dict; raises ``ValueError`` for a
    missing column (naming ``--query-column``...), split or benchmark."""
    from raggedvl.evaluation.benchmark import load_benchmark
    from raggedvl.evaluation.evaluator import evaluate_benchmark, random_baseline
    from raggedvl.app.column_flags import flags_for_columns
    from raggedvl.app.setup import load_splits
    from raggedvl.data.columns import Columns
    from raggedvl.data.source import DataSource

    path = Path(path)
    columns = {"query_column": query_column, "image_column": image_column, "id_column": id_column}
    info = init_distributed()
    try:
        model, processor, cfg, described = load_model(path, info.device)
        if dataset is None:
            if cfg is None:
                raise ValueError(f"{path} is not a raggedvl run: name the benchmark with --dataset PATH_OR_ID")
            cfg = dataclasses.replace(cfg, eval_split=split or cfg.eval_split,
                                      max_eval_samples=max_samples if max_samples is not None else cfg.max_eval_samples,
                                      **{f"eval_{k}": v for k, v in columns.items() if v is not None})
            _, bench = load_splits(cfg, warn=info.is_main, eval_flags="")
            name, split = cfg.eval_dataset or cfg.datasets[0], cfg.resolved_eval_split
        else:
            split = split or DataSource.of(dataset).default_split("test")
            given = Columns(query=query_column or "query", image=image_column or "image", id=id_column or None)
            with flags_for_columns(keys=False):
                bench = load_benchmark(dataset, split, limit=max_samples, on_bad_image=on_bad_image, columns=given)
            name = dataset
        collate = checkpoint_collator(model, processor, cfg, on_bad_image=on_bad_image)
        metrics = evaluate_benchmark(model, collate, bench, batch_size=batch_size, device=info.device, progress=info.is_main)
        results = {
            "dataset": str(name), "split": split, "model": described, "raggedvl_version": __version__,
            "metrics": {k: metrics[k] for k in METRICS}, "random_ranker": random_baseline(bench),
            "counts": {**bench.counts(), "skipped_documents": metrics["skipped_documents"]},
            "mean_rank": metrics["mean_rank"], "random_mean_rank": metrics["random_mean_rank"],
            "random_mean_rank_se": metrics["random_mean_rank_se"],
            "doc_mean_cosine": metrics["doc_mean_cosine"], "world_size": info.world_size,
        }
        collapse = doc_cosine_warning(metrics["doc_mean_cosine"])  # the run summary's criterion
        results["collapsed"] = collapse is not None
        if info.is_main:
            output = Path(output) if output is not None else results_folder(described["path"]) / f"{file_slug(name)}-{split}.json"
            output.parent.mkdir(parents=True, exist_ok=True)
            output.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
            print(f"{described['path']}: {name} split {split!r}, {counted(len(bench.queries), 'query', 'queries')}, "
                  f"{counted(len(bench.documents), 'document')}")
            print(format_metrics_table({"random ranker": results["random_ranker"], "checkpoint": metrics}))
            print(f"first relevant document's mean rank {metrics['mean_rank']:.1f} (random ranker {metrics['random_mean_rank']:.1f}); "
                  f"documents' mean pairwise cosine {metrics['doc_mean_cosine']:.4f}; results written to {output}")
            if collapse:
                print(collapse)
        return results
    finally:
        shutdown()

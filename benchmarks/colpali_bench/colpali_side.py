"""The colpali-engine side of the benchmark: the command that runs ``colpali_worker.py`` (plain
``python`` for one process, as a user runs the HF Trainer; torchrun for several), its spec, what
the run wrote, and the evaluation of a ColQwen2 checkpoint."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from .settings import LORA_DROPOUT, LR_SCHEDULE, RunSettings

WORKER = Path(__file__).with_name("colpali_worker.py")


def spec(s: RunSettings, *, train_parquet: str, out_dir: str, save_final: bool) -> dict[str, Any]:
    return {
        "model": s.model, "train_parquet": train_parquet, "out_dir": out_dir, "max_pixels": s.max_pixels,
        "per_device_batch": s.per_device_batch, "steps": s.steps, "lr": s.lr, "head_lr": s.head_lr,
        "warmup_steps": s.warmup_steps, "weight_decay": s.weight_decay, "max_grad_norm": s.max_grad_norm,
        "temperature": s.temperature, "seed": s.seed, "save_final": save_final, "nproc": s.nproc,
        "lora": None if s.lora_r is None else {"r": s.lora_r, "alpha": s.lora_r, "dropout": LORA_DROPOUT},
    }


def training_arguments(spec: dict[str, Any], args_class: type | None = None, **extra: Any):
    """The HF ``TrainingArguments`` of the colpali run: colpali-engine's ``ColModelTraining`` takes
    them from its YAML config; here every comparison setting is spelled out (linear schedule with
    warm-up, AdamW defaults, gloo on CPU, no checkpoints, no data-loader workers, as raggedvl).
    ``args_class`` (a ``TrainingArguments`` subclass, e.g. sentence-transformers') and ``extra``
    fields give another HF-Trainer-based side the same settings."""
    from transformers import TrainingArguments

    return (args_class or TrainingArguments)(
        output_dir=str(Path(spec["out_dir"]) / "hf"), per_device_train_batch_size=spec["per_device_batch"],
        max_steps=spec["steps"], learning_rate=spec["lr"], lr_scheduler_type=LR_SCHEDULE, warmup_steps=spec["warmup_steps"],
        weight_decay=spec["weight_decay"], max_grad_norm=spec["max_grad_norm"], logging_steps=spec.get("logging_steps", 10),
        save_strategy="no", report_to="none", use_cpu=True, dataloader_num_workers=0,
        ddp_backend="gloo" if spec["nproc"] > 1 else None,  # one process: no process group (plain python)
        seed=spec["seed"], remove_unused_columns=False, disable_tqdm=True, **extra,
    )


def command(s: RunSettings, spec_path: str, worker: Path = WORKER) -> list[str]:
    """``worker --spec spec_path``: plain ``python`` for one process, torchrun for several."""
    if s.nproc == 1:
        return [sys.executable, str(worker), "--spec", spec_path]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(s.nproc),
            str(worker), "--spec", spec_path]


def read_run(out_dir: str | Path, global_batch: int, prefix: str = "colpali") -> dict[str, Any]:
    """Steps (end times in seconds since the loop began; ``global_batch`` samples each, as the
    HF Trainer's per-device batches on equal-count shards give), padding totals summed over
    ranks, start-up phases of rank 0, from the ``{prefix}_rank*.json`` files of an HF Trainer
    worker (``colpali_worker.py``; sentence-transformers' ``st_worker.py`` writes ``st_rank*``)."""
    ranks = [json.loads(p.read_text()) for p in sorted(Path(out_dir).glob(f"{prefix}_rank*.json"))]
    if not ranks:
        raise ValueError(f"{out_dir}: the run wrote no {prefix}_rank*.json (see its log)")
    main = next(r for r in ranks if r["rank"] == 0)
    steps = [{"step": st["step"], "loss": st["loss"], "t": st["t"] - main["loop_begin"], "samples": global_batch}
             for st in main["steps"]]
    totals: dict[str, int] = {}
    for r in ranks:
        for k, v in r["padding"].items():
            totals[k] = totals.get(k, 0) + v
    phases = {"imports_s": main["t_imports"] - main["t_start"], "setup_s": main["t_ready"] - main["t_imports"],
              "to_loop_s": main["loop_begin"] - main["t_ready"], "after_loop_s": main["t_end"] - main["t_trained"]}
    return {"steps": steps, "padding": totals, "phases": phases, "optimizer": main.get("optimizer"),
            "optimizer_defaults": main.get("optimizer_defaults")}


def evaluate(checkpoint: str, dev_parquet: str, max_pixels: int, batch_size: int = 8) -> dict[str, float]:
    """dev metrics of a ColQwen2 checkpoint through colpali-engine's own processor and model
    (``process_queries`` / ``process_images``, ``ColQwen2.forward``); scores are MaxSim over each
    item's valid tokens (attention mask) and metrics come from ``raggedvl.evaluation.score_metrics``
    with the ids raggedvl's ``evaluate_benchmark`` uses (trec_eval tie order): the same scoring and
    metric code as the raggedvl side."""
    import torch
    from colpali_engine.models import ColQwen2, ColQwen2Processor
    from datasets import load_dataset

    from raggedvl.evaluation import mean_pairwise_cosine, score_metrics
    from raggedvl.evaluation.search import pad_rows
    from raggedvl.losses import late_interaction_scores

    processor = ColQwen2Processor.from_pretrained(checkpoint, max_num_visual_tokens=max_pixels // (28 * 28))
    model = ColQwen2.from_pretrained(checkpoint, dtype=torch.float32).eval()
    data = load_dataset("parquet", data_files={"dev": dev_parquet}, split="dev")
    queries, docs = [], []
    with torch.no_grad():
        for lo in range(0, len(data), batch_size):
            rows = data[lo: lo + batch_size]
            for batch, out in ((processor.process_queries(texts=rows["query"]), queries), (processor.process_images(rows["image"]), docs)):
                emb = model(**batch)
                out += [e[m.bool()].float() for e, m in zip(emb, batch["attention_mask"])]
    n = len(queries)
    scores = late_interaction_scores(*pad_rows(queries), *pad_rows(docs))
    metrics = score_metrics(scores, [{i: 1} for i in range(n)], [f"{i:08d}" for i in range(n)])
    metrics["doc_mean_cosine"] = mean_pairwise_cosine(torch.stack([d.mean(dim=0) for d in docs]))
    metrics["n"] = len(queries)
    return metrics

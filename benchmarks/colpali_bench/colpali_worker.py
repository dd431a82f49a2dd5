"""One colpali-engine training run, through colpali-engine's own training path.

    python colpali_worker.py --spec SPEC.json                       # 1 process
    python -m torch.distributed.run --standalone --nproc-per-node W colpali_worker.py --spec SPEC.json

What ``ColModelTraining.train`` does, spelled out so the run can be timed: ``ColQwen2`` and
``ColQwen2Processor`` from the checkpoint (``max_num_visual_tokens = max_pixels / 784``, the
processor's own knob), a ``ColPaliEngineDataset`` over the pairs' parquet (``query`` and
``image`` columns), ``VisualRetrieverCollator``, ``ColbertLoss(temperature, normalize_scores=True)``
and ``ContrastiveTrainer`` (an HF ``Trainer``: HF ``TrainingArguments``, linear schedule with
warm-up, AdamW, gradient clipping, DDP over gloo under torchrun, documents all-gathered with
gradient in the loss). Additions, all outside colpali-engine's code:

- a collator subclass that adds up, per batch, real vs padded document and query tokens and
  real vs padded ``pixel_values`` rows (colpali pads each image's patches to the batch's largest);
- a loss wrapper that keeps the last loss (detached) and the gathered documents' mean pairwise
  cosine, and a callback that at each step's end all-reduces the loss to the global-batch loss
  (one extra all-reduce of one float per step), records the wall-clock time and, with
  ``stop_after`` in the spec, ends training after that many steps (the learning-rate schedule
  still spans ``steps``);
- with ``lora`` in the spec, ``get_peft_model`` with the ``LoraConfig`` of colpali-engine's
  ColQwen2 recipe (``train_colqwen2_model.yaml``: the language model's projections and
  ``custom_text_proj``, the vision tower frozen, gaussian init) at the spec's r, alpha and
  dropout, as ``ColModelTraining`` applies its ``peft_config``;
- with a head learning rate different from the backbone's, an AdamW with two parameter groups
  (``custom_text_proj`` vs the rest) passed to the Trainer (HF still builds the schedule).

Writes ``OUT/colpali_rank{R}.json``: phase times (epoch seconds), per-step times and global
losses (rank 0), padding totals. With ``save_final`` rank 0 saves the model and processor to
``OUT/final`` as ``ColModelTraining.save`` does.
"""

from __future__ import annotations

import time

T_START = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from colpali_engine.collators import VisualRetrieverCollator  # noqa: E402
from colpali_engine.data.dataset import ColPaliEngineDataset  # noqa: E402
from colpali_engine.loss import ColbertLoss  # noqa: E402
from colpali_engine.models import ColQwen2, ColQwen2Processor  # noqa: E402
from colpali_engine.trainer import ContrastiveTrainer  # noqa: E402
from datasets import load_dataset  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from colpali_bench.colpali_side import training_arguments  # noqa: E402
from colpali_bench.step_clock import StepClock  # noqa: E402

T_IMPORTS = time.time()


class PaddingStatsCollator(VisualRetrieverCollator):
    """``VisualRetrieverCollator`` that also counts real and padded tokens and patch rows."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.totals = {k: 0 for k in ("doc_tokens", "doc_slots", "query_tokens", "query_slots", "pixel_rows", "pixel_slots", "batches")}

    def __call__(self, examples):
        batch = super().__call__(examples)
        t = self.totals
        t["doc_tokens"] += int(batch["doc_attention_mask"].sum())
        t["doc_slots"] += batch["doc_attention_mask"].numel()
        t["query_tokens"] += int(batch["query_attention_mask"].sum())
        t["query_slots"] += batch["query_attention_mask"].numel()
        t["pixel_rows"] += int(batch["doc_image_grid_thw"].prod(dim=-1).sum())
        t["pixel_slots"] += batch["doc_pixel_values"].shape[0] * batch["doc_pixel_values"].shape[1]
        t["batches"] += 1
        return batch


class RecordingLoss(torch.nn.Module):
    """Calls the colpali loss unchanged and keeps the last value (detached) and the mean pairwise
    cosine of the (gathered) documents' mean-pooled embeddings (zeroed padding excluded)."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.last: torch.Tensor | None = None
        self.doc_cosine = float("nan")

    def forward(self, query_embeddings, doc_embeddings, *args, **kwargs):
        loss = self.inner(query_embeddings, doc_embeddings, *args, **kwargs)
        self.last = loss.detach()
        with torch.no_grad():
            d = doc_embeddings.detach().double()
            real = (d.abs().sum(dim=-1) > 0).unsqueeze(-1).double()
            pooled = torch.nn.functional.normalize((d * real).sum(dim=1) / real.sum(dim=1).clamp(min=1), dim=-1)
            n = pooled.shape[0]
            sim = pooled @ pooled.T
            self.doc_cosine = float((sim.sum() - sim.diagonal().sum()) / (n * (n - 1))) if n > 1 else float("nan")
        return loss


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True)
    spec = json.loads(Path(parser.parse_args().spec).read_text())
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    rank = int(os.environ.get("RANK", "0"))
    out = Path(spec["out_dir"])

    processor = ColQwen2Processor.from_pretrained(spec["model"], max_num_visual_tokens=spec["max_pixels"] // (28 * 28))
    longest = processor.image_processor.size["longest_edge"]
    if longest != spec["max_pixels"] // (28 * 28) * 28 * 28:
        raise ValueError(f"colpali processor kept longest_edge={longest}, asked for max_pixels={spec['max_pixels']}")
    model = ColQwen2.from_pretrained(spec["model"], dtype=torch.float32)
    if spec.get("lora"):
        from peft import LoraConfig, get_peft_model

        lora = spec["lora"]
        model = get_peft_model(model, LoraConfig(
            r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"], init_lora_weights="gaussian", bias="none",
            task_type="FEATURE_EXTRACTION",
            target_modules=r"(.*(model)(?!.*visual).*(down_proj|gate_proj|up_proj|k_proj|q_proj|v_proj|o_proj).*$|.*(custom_text_proj).*$)"))
    data = load_dataset("parquet", data_files={"train": spec["train_parquet"]}, split="train")
    train_dataset = ColPaliEngineDataset(data, query_column_name="query", pos_target_column_name="image")
    collator = PaddingStatsCollator(processor=processor)
    loss = RecordingLoss(ColbertLoss(temperature=spec["temperature"], normalize_scores=True))
    clock = StepClock(loss, spec.get("stop_after"))
    args = training_arguments(spec)
    optimizers = (None, None)
    if spec.get("head_lr") not in (None, spec["lr"]):
        head = [p for n, p in model.named_parameters() if n.startswith("custom_text_proj")]
        body = [p for n, p in model.named_parameters() if not n.startswith("custom_text_proj")]
        optimizers = (torch.optim.AdamW([{"params": body, "lr": spec["lr"]}, {"params": head, "lr": spec["head_lr"]}],
                                        lr=spec["lr"], weight_decay=spec["weight_decay"]), None)
    trainer = ContrastiveTrainer(
        model=model, train_dataset=train_dataset, eval_dataset=None, args=args, data_collator=collator,
        loss_func=loss, is_vision_model=True, callbacks=[clock], optimizers=optimizers,
    )
    t_ready = time.time()
    trainer.train()
    t_trained = time.time()
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # accelerate wraps it
    if spec.get("save_final") and rank == 0:
        model.save_pretrained(str(out / "final"))
        processor.save_pretrained(str(out / "final"))
    record = {
        "rank": rank, "world_size": int(os.environ.get("WORLD_SIZE", "1")),
        "t_start": T_START, "t_imports": T_IMPORTS, "t_ready": t_ready, "loop_begin": clock.loop_begin,
        "t_trained": t_trained, "t_end": time.time(), "steps": clock.steps if rank == 0 else [],
        "padding": collator.totals, "optimizer": type(optimizer).__name__,
        "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "optimizer_defaults": {k: v for k, v in optimizer.defaults.items() if isinstance(v, (int, float, bool, str, type(None)))},
    }
    (out / f"colpali_rank{rank}.json").write_text(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()

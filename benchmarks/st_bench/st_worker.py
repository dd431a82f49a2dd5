"""One sentence-transformers training run, through sentence-transformers' own training path.

    python st_worker.py --spec SPEC.json                       # 1 process
    python -m torch.distributed.run --standalone --nproc-per-node W st_worker.py --spec SPEC.json

``MultiVectorEncoder(folder, similarity_fn_name="meanmaxsim")`` (the folder ``raggedvl export
--format sentence-transformers`` wrote; the folder's pixel limits with the spec's max_pixels through
``processor_kwargs``),
the pairs' parquet as a ``datasets.Dataset`` with columns ``query`` and ``image`` (column 0 is the
query task, the image the document task), the folder's prompts as the trainer's per-column
prompts, ``MultiVectorMultipleNegativesRankingLoss(scale=1/temperature,
similarity_fct=mean_colbert_scores, gather_across_devices=W > 1)`` and ``MultiVectorEncoderTrainer`` (an HF ``Trainer``: its
``MultiVectorEncoderTrainingArguments`` with the settings of ``colpali_side.training_arguments``,
linear schedule with warm-up, AdamW, gradient clipping, DDP over gloo under torchrun). MeanMaxSim
with ``scale = 1 / temperature`` is raggedvl's default late-interaction objective (docs/interop.md).
The scorer is given explicitly: the loss's default reads ``model.similarity``, which the trainer's
``DistributedDataParallel`` wrapper does not expose in sentence-transformers 6.3 (an
``AttributeError`` under torchrun); ``mean_colbert_scores`` is the same MeanMaxSim, on any
number of processes.

sentence-transformers loads the processor with transformers' ``AutoProcessor``, whose
``Qwen2VLProcessor`` needs torchvision for its video processor. Where torchvision is missing, the
worker stands in raggedvl's ``Qwen2VLProcessor`` subclass without videos (``build_processor``:
the same text and image behaviour, the same resize kernel) for ``AutoProcessor``, as
``tests/models/interop/test_multi_vector_encoder.py`` does; the spec's pixel limits reach it the
same way. Everything else is sentence-transformers' code. Additions, outside it:

- a collator subclass that adds up, per batch, real vs padded document and query tokens and
  real vs padded ``pixel_values`` rows;
- a loss subclass that keeps the last loss (detached), and ``StepClock`` (``colpali_bench``):
  per step the global-batch loss and the wall-clock time;
- with ``lora`` in the spec, LoRA on the language model's projections through peft's
  ``inject_adapter_in_model`` (what sentence-transformers' ``add_adapter`` calls through
  transformers, which asks for a newer peft than the newest release), with the pattern and settings of raggedvl's ``--lora``
  (``raggedvl.models.lora``): the vision tower and the base weights frozen, the ``Dense`` head
  trained in full, as raggedvl trains its head;
- with ``batches`` in the spec (one process), the trainer's ``batch_sampler`` yields those row
  batches in that order (``PlannedBatches``) instead of drawing its own: the batches ``raggedvl
  train`` draws, so both sides see the same samples at every step.

Writes ``OUT/st_rank{R}.json`` in the layout of ``colpali_worker.py`` (read by
``colpali_side.read_run``). With ``save_final`` rank 0 saves the trained model with
``MultiVectorEncoder.save_pretrained`` to ``OUT/final`` (after the loop, as ``colpali_worker.py``).
"""

from __future__ import annotations

import time

T_START = time.time()

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import sentence_transformers.base.modules.transformer as st_transformer  # noqa: E402
import torch  # noqa: E402
from datasets import load_dataset  # noqa: E402
from sentence_transformers import MultiVectorEncoder, MultiVectorEncoderTrainer  # noqa: E402
from sentence_transformers.base.sampler import DefaultBatchSampler  # noqa: E402
from sentence_transformers.multi_vector_encoder.data_collator import MultiVectorEncoderDataCollator  # noqa: E402
from sentence_transformers.multi_vector_encoder.losses import MultiVectorMultipleNegativesRankingLoss  # noqa: E402
from sentence_transformers.multi_vector_encoder.scoring import mean_colbert_scores  # noqa: E402
from sentence_transformers.multi_vector_encoder.training_args import MultiVectorEncoderTrainingArguments  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from colpali_bench.colpali_side import training_arguments  # noqa: E402
from colpali_bench.step_clock import StepClock  # noqa: E402

T_IMPORTS = time.time()


class _PilProcessor:
    """``AutoProcessor`` where torchvision is missing: raggedvl's torchvision-free processor of the
    same folder, with the ``size`` limits sentence-transformers forwards from ``processor_kwargs``."""

    @staticmethod
    def from_pretrained(path, size=None, **_):
        from raggedvl.data import build_processor

        size = size or {}
        return build_processor(str(path), min_pixels=size.get("shortest_edge"), max_pixels=size.get("longest_edge"))


@dataclasses.dataclass
class PaddingStatsCollator(MultiVectorEncoderDataCollator):
    """sentence-transformers' collator that also counts real and padded tokens and patch rows."""

    totals: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(
        ("doc_tokens", "doc_slots", "query_tokens", "query_slots", "pixel_rows", "pixel_slots", "batches"), 0))

    def __call__(self, features):
        batch = super().__call__(features)
        t = self.totals
        for column, key in (("query", "query"), ("image", "doc")):
            mask = batch[f"{column}_attention_mask"]
            t[f"{key}_tokens"] += int(mask.sum())
            t[f"{key}_slots"] += mask.numel()
        t["pixel_rows"] += int(batch["image_image_grid_thw"].prod(dim=-1).sum())
        t["pixel_slots"] += batch["image_pixel_values"].shape[0]
        t["batches"] += 1
        return batch


class PlannedBatches(DefaultBatchSampler):
    """sentence-transformers' batch sampler interface over a fixed list of row batches, yielded in
    order (one pass = every step of the run)."""

    def __init__(self, dataset, batches: list[list[int]], batch_size: int, drop_last: bool, **kwargs) -> None:
        if any(len(b) != batch_size for b in batches):
            raise ValueError(f"planned batches must hold per_device_batch={batch_size} rows each, "
                             f"got sizes {sorted({len(b) for b in batches})}")
        super().__init__(dataset, batch_size=batch_size, drop_last=drop_last, **kwargs)
        self.batches = batches

    def __iter__(self):
        yield from (list(b) for b in self.batches)

    def __len__(self) -> int:
        return len(self.batches)


class RecordingLoss(MultiVectorMultipleNegativesRankingLoss):
    """The multi-vector MNRL unchanged; keeps the last value (detached) for ``StepClock``."""

    last: torch.Tensor | None = None
    doc_cosine = float("nan")

    def forward(self, sentence_features, labels=None):
        loss = super().forward(sentence_features, labels)
        self.last = loss.detach()
        return loss


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True)
    spec = json.loads(Path(parser.parse_args().spec).read_text())
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    rank = int(os.environ.get("RANK", "0"))
    out = Path(spec["out_dir"])

    if importlib.util.find_spec("torchvision") is None:
        st_transformer.AutoProcessor = _PilProcessor
    size = json.loads((Path(spec["model"]) / "processor_config.json").read_text())["image_processor"]["size"]
    model = MultiVectorEncoder(spec["model"], local_files_only=True, similarity_fn_name="meanmaxsim",
                               processor_kwargs={"size": {**size, "longest_edge": spec["max_pixels"]}})
    longest = model[0].processor.image_processor.size["longest_edge"]
    if longest != spec["max_pixels"]:
        raise ValueError(f"sentence-transformers' processor kept longest_edge={longest}, asked for max_pixels={spec['max_pixels']}")
    if spec.get("lora"):
        from peft import LoraConfig, inject_adapter_in_model

        from raggedvl.models.lora import DEFAULT_TARGETS

        lora = spec["lora"]
        config = LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"], bias="none",
                            target_modules=rf"(.*\.)?language_model\..*\.({'|'.join(DEFAULT_TARGETS)})")
        inject_adapter_in_model(config, model.transformers_model)  # what add_adapter does (it needs peft >= 0.22)
    data = load_dataset("parquet", data_files={"train": spec["train_parquet"]}, split="train").select_columns(["query", "image"])
    prompts = {"query": model.prompts["query"], "image": model.prompts["document"]}
    collator = PaddingStatsCollator(preprocess_fn=model.preprocess, prompts=prompts)
    loss = RecordingLoss(model, scale=1.0 / spec["temperature"], similarity_fct=mean_colbert_scores,
                         gather_across_devices=spec["nproc"] > 1)
    clock = StepClock(loss, spec.get("stop_after"))
    planned = {}
    if spec.get("batches"):
        if spec["nproc"] != 1:
            raise ValueError(f"planned batches need one process (the trainer would shard them), got nproc={spec['nproc']}")
        planned = {"batch_sampler": lambda dataset, **kw: PlannedBatches(dataset, spec["batches"], **kw)}
    args = training_arguments(spec, MultiVectorEncoderTrainingArguments, prompts=prompts, **planned)
    trainer = MultiVectorEncoderTrainer(model=model, args=args, train_dataset=data, loss=loss, data_collator=collator,
                                        callbacks=[clock])
    t_ready = time.time()
    trainer.train()
    t_trained = time.time()
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # accelerate wraps it
    if spec.get("save_final") and rank == 0:
        model.save_pretrained(str(out / "final"), create_model_card=False)
    record = {
        "rank": rank, "world_size": int(os.environ.get("WORLD_SIZE", "1")),
        "t_start": T_START, "t_imports": T_IMPORTS, "t_ready": t_ready, "loop_begin": clock.loop_begin,
        "t_trained": t_trained, "t_end": time.time(), "steps": clock.steps if rank == 0 else [],
        "padding": collator.totals, "optimizer": type(optimizer).__name__,
        "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "optimizer_defaults": {k: v for k, v in optimizer.defaults.items() if isinstance(v, (int, float, bool, str, type(None)))},
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / f"st_rank{rank}.json").write_text(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()

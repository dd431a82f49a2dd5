"""Train a ColQwen-style visual retriever with the Hugging Face Trainer and raggedvl.

Tiny model on the embedded R-manual pages, on CPU (about a minute):

    python examples/train_retriever_hf.py --max-steps 20

The same script in the other launch modes:

    torchrun --nproc_per_node 2 examples/train_retriever_hf.py --max-steps 20     # DDP (gloo on CPU, NCCL on GPUs)
    python examples/train_retriever_hf.py --streaming --max-steps 20              # IterableDataset: accelerate dispatch_batches
    python examples/train_retriever_hf.py --model Qwen/Qwen2-VL-2B-Instruct --lora --bf16   # several GPUs: RaggedDataParallel
    torchrun --nproc_per_node 8 examples/train_retriever_hf.py --model Qwen/Qwen2-VL-2B-Instruct \\
        --lora --bf16 --gradient-checkpointing --batch-size 8 --max-steps 1000 --learning-rate 5e-5

Every process contrasts its queries against the documents of all processes (exact cross-rank
late-interaction loss); the logged loss is the loss of the global batch.
"""

from __future__ import annotations

import argparse
import math
from typing import Any, Sequence

import torch
from torch.utils.data import IterableDataset
from transformers import TrainingArguments

from raggedvl import RetrievalBenchmark, evaluate_benchmark
from raggedvl.data import RetrievalCollator, RetrievalDataset, build_processor, build_rdocs
from raggedvl.hf import RaggedTrainer, RetrievalWireCollator
from raggedvl.models import LoraSettings, build_retriever
from raggedvl.parallel import shutdown


class Streaming(IterableDataset):
    """The pairs as a stream (as from ``datasets`` streaming): accelerate then dispatches batches."""

    def __init__(self, pairs: Sequence[dict[str, Any]]) -> None:
        self.pairs = pairs

    def __iter__(self):
        return (self.pairs[i] for i in range(len(self.pairs)))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", help="'tiny', a hub id or a local Qwen2-VL-family checkpoint")
    p.add_argument("--output-dir", default="runs/hf-retriever")
    p.add_argument("--train-pairs", type=int, default=64, help="rdocs training pairs")
    p.add_argument("--eval-pairs", type=int, default=32, help="rdocs dev pairs scored before and after (0: skip)")
    p.add_argument("--max-pixels", type=int, default=None, help="resize limit per image (default: the processor's)")
    p.add_argument("--max-length", type=int, default=None)
    p.add_argument("--head", choices=("late_interaction", "bi_encoder"), default="late_interaction")
    p.add_argument("--batch-size", type=int, default=4, help="pairs per device and step")
    p.add_argument("--max-steps", type=int, default=20)
    p.add_argument("--learning-rate", type=float, default=5e-4)
    p.add_argument("--lora", action="store_true", help="peft LoRA on the language model (real checkpoints)")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--streaming", action="store_true", help="feed an IterableDataset (accelerate dispatch_batches)")
    p.add_argument("--logging-steps", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def evaluate(trainer: RaggedTrainer, dev, collate) -> dict[str, float] | None:
    """Every process calls this: encoding is sharded over the processes and gathered (a collective)."""
    if dev is None:
        return None
    model = trainer.accelerator.unwrap_model(trainer.model)
    return evaluate_benchmark(model.eval(), collate, RetrievalBenchmark.from_pairs(dev), batch_size=8,
                              device=trainer.args.device)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    data_dir = build_rdocs(train_limit=args.train_pairs, dev_limit=max(args.eval_pairs, 1))
    train = RetrievalDataset.from_manifest(data_dir, split="train")
    dev = RetrievalDataset.from_manifest(data_dir, split="dev", limit=args.eval_pairs) if args.eval_pairs else None
    # --- README: hf-trainer ---
    processor = build_processor(args.model, max_pixels=args.max_pixels)
    model = build_retriever(args.model, processor=processor, head=args.head, seed=args.seed,
                            lora=LoraSettings() if args.lora else None,
                            torch_dtype="bfloat16" if args.bf16 else None,
                            gradient_checkpointing=args.gradient_checkpointing)
    collate = RetrievalCollator(processor, max_length=args.max_length)
    training_args = TrainingArguments(
        output_dir=args.output_dir, per_device_train_batch_size=args.batch_size, max_steps=args.max_steps,
        learning_rate=args.learning_rate, warmup_steps=math.ceil(0.1 * args.max_steps), logging_steps=args.logging_steps,
        save_strategy="no", report_to=[], seed=args.seed, bf16=args.bf16, use_cpu=not torch.cuda.is_available(),
    )
    trainer = RaggedTrainer(
        model, training_args, processor=processor,  # exact cross-rank contrastive loss
        train_dataset=Streaming(train) if args.streaming else train,
        data_collator=RetrievalWireCollator(collate),  # ragged batches that survive every launch mode
    )
    # --- end README ---
    before = evaluate(trainer, dev, collate)
    trainer.train()
    after = evaluate(trainer, dev, collate)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    if trainer.is_world_process_zero():
        trend = f"loss {losses[0]:.3f} -> {losses[-1]:.3f}" if losses else f"no loss logged (--logging-steps {args.logging_steps})"
        print(f"{trend} over {args.max_steps} steps "
              f"({trainer.args.world_size} process(es), {trainer.args.n_gpu} GPU(s) per process)")
        for name, metrics in (("before", before), ("after", after)):
            if metrics:
                print(f"dev {name}: nDCG@5 {metrics['ndcg@5']:.3f}  Recall@1 {metrics['recall@1']:.3f}  ({metrics['documents']} pages)")
    return {"losses": losses, "before": before, "after": after}


if __name__ == "__main__":
    main()
    # under torchrun the HF Trainer leaves its gloo/NCCL process group to interpreter exit, where
    # gloo's worker threads can abort the process (SIGABRT, "terminate called without an active
    # exception", pytorch/pytorch#179291): destroy it while Python is still whole
    shutdown()

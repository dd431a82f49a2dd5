"""Generative fine-tuning (SFT) of a Qwen2-VL-family model on multi-image samples with the HF Trainer.

Each sample shows two R-manual pages and asks for their titles; the loss is the model's own
causal-LM loss on the answer only (prompt, image placeholders and padding are masked).

Tiny model on the embedded R-manual pages, on CPU (about a minute):

    python examples/sft_hf.py --max-steps 20

Other launch modes and real checkpoints:

    torchrun --nproc_per_node 2 examples/sft_hf.py --max-steps 20                 # DDP
    python examples/sft_hf.py --streaming --max-steps 20                          # accelerate dispatch_batches
    python examples/sft_hf.py --model Qwen/Qwen2-VL-2B-Instruct --lora --bf16       # several GPUs: RaggedDataParallel
    torchrun --nproc_per_node 8 examples/sft_hf.py --model Qwen/Qwen2-VL-2B-Instruct --lora --bf16 \\
        --gradient-checkpointing --batch-size 4 --max-steps 500 --learning-rate 1e-4
"""

from __future__ import annotations

import argparse
import math
from typing import Any, Sequence

import torch
from torch.utils.data import IterableDataset
from transformers import AutoModelForImageTextToText, Qwen2VLForConditionalGeneration, TrainingArguments

from raggedvl.data import RetrievalDataset, build_processor, build_rdocs
from raggedvl.hf import RaggedSFTTrainer, SFTCollator, apply_generation_lora
from raggedvl.models import LoraSettings, tiny_backbone_config
from raggedvl.parallel import shutdown

PROMPT = "Give the title of each page, one per line.\n"


class TwoPageTitles:
    """Sample k: pages 2k and 2k+1 of the rdocs pairs, answered by their two queries."""

    def __init__(self, pairs: RetrievalDataset) -> None:
        self.pairs = pairs

    def __len__(self) -> int:
        return len(self.pairs) // 2

    def __getitem__(self, k: int) -> dict[str, Any]:
        a, b = self.pairs[2 * k], self.pairs[2 * k + 1]
        return {"images": [a["image"], b["image"]], "prompt": PROMPT, "answer": f"{a['query']}\n{b['query']}"}


class Streaming(IterableDataset):
    def __init__(self, samples) -> None:
        self.samples = samples

    def __iter__(self):
        return (self.samples[i] for i in range(len(self.samples)))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", help="'tiny', a hub id or a local Qwen2-VL-family checkpoint")
    p.add_argument("--output-dir", default="runs/hf-sft")
    p.add_argument("--train-pairs", type=int, default=64, help="rdocs pairs (two per sample)")
    p.add_argument("--max-pixels", type=int, default=None, help="resize limit per image (default: the processor's)")
    p.add_argument("--max-length", type=int, default=None, help="refuse (never truncate) longer samples")
    p.add_argument("--batch-size", type=int, default=2, help="samples per device and step")
    p.add_argument("--max-steps", type=int, default=20)
    p.add_argument("--learning-rate", type=float, default=1e-3)
    p.add_argument("--lora", action="store_true", help="peft LoRA on the language model")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--streaming", action="store_true", help="feed an IterableDataset (accelerate dispatch_batches)")
    p.add_argument("--logging-steps", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def load_model(name: str, processor, bf16: bool, seed: int) -> torch.nn.Module:
    if name == "tiny":
        torch.manual_seed(seed)
        model = Qwen2VLForConditionalGeneration(tiny_backbone_config(processor.tokenizer))
        return model.to(torch.bfloat16) if bf16 else model
    return AutoModelForImageTextToText.from_pretrained(name, dtype=torch.bfloat16 if bf16 else None)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    pairs = RetrievalDataset.from_manifest(build_rdocs(train_limit=args.train_pairs, dev_limit=1), split="train")
    samples = TwoPageTitles(pairs)
    processor = build_processor(args.model, max_pixels=args.max_pixels)
    model = load_model(args.model, processor, args.bf16, args.seed)
    if args.lora:
        model = apply_generation_lora(model, LoraSettings())
    training_args = TrainingArguments(
        output_dir=args.output_dir, per_device_train_batch_size=args.batch_size, max_steps=args.max_steps,
        learning_rate=args.learning_rate, warmup_steps=math.ceil(0.1 * args.max_steps), logging_steps=args.logging_steps,
        save_strategy="no", report_to=[], seed=args.seed, bf16=args.bf16, use_cpu=not torch.cuda.is_available(),
        activation_checkpointing=args.gradient_checkpointing,
    )
    trainer = RaggedSFTTrainer(
        model, training_args, processor=processor, train_dataset=Streaming(samples) if args.streaming else samples,
        data_collator=SFTCollator(processor, max_length=args.max_length),
    )
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    if trainer.is_world_process_zero():
        print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {args.max_steps} steps "
              f"({trainer.args.world_size} process(es), {len(samples)} two-page samples)")
    return {"losses": losses}


if __name__ == "__main__":
    main()
    # under torchrun the HF Trainer leaves its gloo/NCCL process group to interpreter exit, where
    # gloo's worker threads can abort the process (SIGABRT, "terminate called without an active
    # exception", pytorch/pytorch#179291): destroy it while Python is still whole
    shutdown()

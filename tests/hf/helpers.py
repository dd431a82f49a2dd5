"""Shared pieces of the HF Trainer tests: the tiny processor, ragged examples, a tiny retriever
and a tiny generative model, all deterministic and built offline."""

from __future__ import annotations

import functools

import torch
from PIL import Image
from torch.utils.data import IterableDataset

# (height, width) in pixels, multiples of 28: grids [1,4,4], [1,8,6], [1,2,2], [1,6,6], ... (case C03)
C03_SIZES = [(56, 56), (112, 84), (28, 28), (84, 84), (56, 112), (28, 56), (84, 28), (112, 112)]
WORDS = ["quantiles", "biplot", "regression", "factor", "matrix", "lists", "packages", "graphics"]


@functools.lru_cache(maxsize=1)
def tiny_processor():
    from raggedvl.data import build_processor

    return build_processor("tiny", min_pixels=28 * 28, max_pixels=112 * 112)


def page(height: int, width: int, seed: int) -> Image.Image:
    """An RGB image whose pixels depend on ``seed`` (so every sample's patches differ)."""
    gen = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=gen, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy(), "RGB")


def retrieval_examples(n: int = 8) -> list[dict]:
    return [
        {"query": f"{WORDS[i % len(WORDS)]} of data {i}", "image": page(*C03_SIZES[i % len(C03_SIZES)], seed=i), "id": f"ex{i}"}
        for i in range(n)
    ]


def retrieval_pairs(n: int = 8):
    """``retrieval_examples(n)`` as a :class:`raggedvl.data.RetrievalDataset` (split "dev")."""
    from raggedvl.data import RetrievalDataset

    examples = retrieval_examples(n)
    return RetrievalDataset([{"query": e["query"], "id": e["id"]} for e in examples], [e["image"] for e in examples], "dev")


def sft_examples() -> list[dict]:
    """Multi-image, single-image and text-only samples."""
    return [
        {"images": [page(56, 56, 1), page(84, 56, 2)], "prompt": "compare the two pages", "answer": "the first is a table"},
        {"images": [], "prompt": "say hello", "answer": "hello"},
        {"images": [page(28, 28, 3), page(28, 56, 4), page(56, 28, 5)], "prompt": "count the figures", "answer": "three plots"},
    ]


def tiny_retriever(dtype=torch.float64, lora=None):
    from raggedvl.models import build_retriever

    return build_retriever("tiny", processor=tiny_processor(), seed=0, lora=lora).to(dtype)


def tiny_generator(dtype=torch.float64):
    from transformers import Qwen2VLForConditionalGeneration

    from raggedvl.models import tiny_backbone_config

    torch.manual_seed(0)
    config = tiny_backbone_config(tiny_processor().tokenizer)
    return Qwen2VLForConditionalGeneration(config).to(dtype)


def training_args(out_dir, **overrides):
    """Deterministic CPU TrainingArguments: plain SGD, constant LR, no clipping, no saving."""
    from transformers import TrainingArguments

    kwargs = dict(
        output_dir=str(out_dir), use_cpu=True, report_to=[], save_strategy="no", logging_steps=1,
        optim="sgd", learning_rate=0.5, lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0,
        per_device_train_batch_size=2, max_steps=2, seed=0, dataloader_num_workers=0, disable_tqdm=True,
    )
    kwargs.update(overrides)
    return TrainingArguments(**kwargs)


class Stream(IterableDataset):
    """``items`` as an ``IterableDataset`` (accelerate then dispatches batches from process 0)."""

    def __init__(self, items):
        self.items = items

    def __iter__(self):
        return iter(self.items)


def trainable(model) -> dict[str, torch.Tensor]:
    """CPU copies of the trainable parameters, by name."""
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters() if p.requires_grad}

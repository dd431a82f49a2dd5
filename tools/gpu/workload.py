"""The timed workload of gpu_check: ColQwen-style training steps, ragged vs pad-per-image,
plain vs GradCache, padded vs packed token rows, for the tiny preset and a mid-size model.

Data: synthetic document pages drawn with PIL (white pages with dark text-like bars) whose sizes
mix a small crop, a half page, a portrait page and a two-page spread, as dynamic-resolution
retrieval data does; queries are short text. The processor is the tiny one
(``build_processor("tiny")``) with ``max_pixels`` per image; both batch forms go through
``RetrievalCollator``:

- ragged: each image at its own resolution (the processor's resize rule), flat
  ``pixel_values`` + ``image_grid_thw`` (what raggedvl ships);
- pad-per-image: every image of a batch first pasted onto a white canvas of the batch's largest
  width x height (the common workaround), so every document gets the largest grid and the model
  computes on the padding.

Step: one optimizer step of a single process, as ``Trainer.train_step`` does it: AdamW,
late-interaction loss (temperature 0.02), bf16 autocast on CUDA (fp32 on CPU); "grad_cache"
is ``raggedvl.gradcache.step.grad_cache_step`` with ``budget`` patches + tokens per chunk.
Time: ``torch.cuda.synchronize`` around ``steps`` timed steps after ``warmup`` steps; samples/s
counts (query, document) pairs. Memory: ``torch.cuda.max_memory_allocated`` over the timed steps
(reset before them): model, AdamW state and activations together. The four modes of a model share
one model and optimizer (built once), so the reported loss (last timed step) moves between rows.
"""

from __future__ import annotations

import contextlib
import random
import time
from dataclasses import dataclass
from typing import Any, Callable

SIZES = [(320, 220), (850, 550), (850, 1100), (1700, 1100)]  # width, height in pixels


@dataclass(frozen=True)
class ModelSpec:
    name: str
    sizes: dict[str, Any] | None  # TinySizes fields; None = the tiny preset's defaults


TINY = ModelSpec("tiny", None)
MID = ModelSpec("mid (text 1024x8, vision depth 8)", dict(
    hidden_size=1024, num_layers=8, num_heads=16, num_kv_heads=4, intermediate_size=4096,
    vision_depth=8, vision_embed_dim=1024, vision_heads=16, initializer_range=0.02,
))


def make_pages(n: int, seed: int) -> list[dict[str, Any]]:
    """``n`` retrieval items ``{"query", "image", "id"}`` with synthetic pages of mixed sizes."""
    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    items = []
    for i in range(n):
        w, h = SIZES[i % len(SIZES)] if i < len(SIZES) else rng.choice(SIZES)
        img = Image.new("RGB", (w, h), "white")
        draw = ImageDraw.Draw(img)
        for y in range(24, h - 24, 28):  # lines of "words"
            x = 24
            while x < w - 60:
                word = rng.randrange(20, 60)
                draw.rectangle([x, y, x + word, y + 12], fill=(rng.randrange(60),) * 3)
                x += word + rng.randrange(8, 16)
        items.append({"query": f"where is topic {rng.randrange(10_000)} in section {i}?", "image": img, "id": f"p{i}"})
    return items


def pad_to_largest(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The same items with every image pasted (top-left) onto a white canvas of the largest
    width x height among them."""
    from PIL import Image

    w = max(it["image"].width for it in items)
    h = max(it["image"].height for it in items)
    out = []
    for it in items:
        canvas = Image.new("RGB", (w, h), "white")
        canvas.paste(it["image"], (0, 0))
        out.append({**it, "image": canvas})
    return out


def build_batches(processor, items: list[dict[str, Any]], batch_size: int, padded: bool) -> list[dict[str, Any]]:
    """Collated ``{"queries", "docs"}`` batches of ``batch_size`` pairs (ragged or padded)."""
    from raggedvl.data import RetrievalCollator

    collate = RetrievalCollator(processor)
    batches = []
    for start in range(0, len(items) - batch_size + 1, batch_size):
        chunk = items[start:start + batch_size]
        batches.append(collate(pad_to_largest(chunk) if padded else chunk))
    return batches


def visual_tokens(batch: dict[str, Any]) -> int:
    """Visual tokens of a batch's documents (patches / merge_size**2)."""
    grid = batch["docs"]["image_grid_thw"]
    return int(grid.prod(-1).sum()) // 4


@dataclass(frozen=True)
class TimingMode:
    label: str
    padded_images: bool  # every page pasted onto the batch's largest canvas
    cached: bool  # GradCache
    packing: bool = False  # padding-free token rows (Retriever.set_packing)
    attn: str | None = None  # attn_implementation (None: sdpa)


def timing_modes(flash: bool) -> list[TimingMode]:
    """The timed modes of one model; the first is the reference of the ratios. The two
    flash_attention_2 modes are listed always (reported as skipped without flash-attn)."""
    modes = [TimingMode(f"{'pad-per-image' if padded else 'ragged'}, {'GradCache' if cached else 'plain'}", padded, cached)
             for padded in (False, True) for cached in (False, True)]
    modes += [TimingMode(f"ragged, packed, {'GradCache' if cached else 'plain'}", False, cached, packing=True)
              for cached in (False, True)]
    modes += [TimingMode(f"ragged, {'packed, ' if packing else ''}flash_attention_2, plain", False, False, packing=packing,
                         attn="flash_attention_2") for packing in (False, True)]
    return modes


def token_padding(batches: list[dict[str, Any]]) -> float:
    """Share of the padded token slots (queries and documents) that are padding."""
    masks = [b[key]["attention_mask"] for b in batches for key in ("queries", "docs")]
    return 1 - sum(int(m.sum()) for m in masks) / sum(m.numel() for m in masks)


def build_model(spec: ModelSpec, processor, device, attn: str | None = None):
    import torch

    from raggedvl.models import TinySizes, build_retriever

    sizes = TinySizes(**spec.sizes) if spec.sizes else None
    model = build_retriever("tiny", processor=processor, head="late_interaction", dim=128, tiny_sizes=sizes, seed=0,
                            attn_implementation=attn)
    model = model.to(device).train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    return model, optimizer


def _loss_fn() -> Callable:
    from raggedvl.losses import make_retrieval_loss

    return make_retrieval_loss("late_interaction", temperature=0.02)


def time_steps(model, optimizer, batches: list[dict[str, Any]], device, *, grad_cache: bool, budget: int,
               warmup: int, steps: int) -> dict[str, float]:
    """Run ``warmup`` + ``steps`` optimizer steps cycling over ``batches`` (already on ``device``).

    Returns ``{"samples_per_s", "step_s", "peak_gib", "loss"}`` (peak_gib is NaN on CPU)."""
    import torch

    from raggedvl.gradcache import grad_cache_step

    cuda = device.type == "cuda"
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else contextlib.nullcontext()
    loss_fn = _loss_fn()

    def step(batch) -> float:
        optimizer.zero_grad(set_to_none=True)
        if grad_cache:
            loss = grad_cache_step(model, batch["queries"], batch["docs"], loss_fn, budget=budget, autocast=autocast).loss
        else:
            with autocast:
                q, d = model(queries=batch["queries"], docs=batch["docs"])
            loss = loss_fn(q, d)
            loss.backward()
        optimizer.step()
        return loss

    for i in range(warmup):
        step(batches[i % len(batches)])
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    pairs = 0
    t0 = time.perf_counter()
    for i in range(steps):
        batch = batches[i % len(batches)]
        loss = step(batch)
        pairs += batch["queries"].num_samples
    if cuda:
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else float("nan")
    return {"samples_per_s": pairs / elapsed, "step_s": elapsed / steps, "peak_gib": peak, "loss": float(loss.detach())}

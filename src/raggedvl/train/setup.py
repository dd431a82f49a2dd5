"""Build what a training run needs from its config: data, processor, model, sampler, loss.

Every rank calls :func:`build_components` with the same config and gets identical datasets
and an identical freshly initialised model (the seed is set by the caller); only the sampler
differs by rank.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from filelock import FileLock
from torch.utils.data import Subset

from raggedvl.data import RetrievalCollator, build_processor, build_rdocs, load_retrieval_dataset
from raggedvl.data.cache import cache_root
from raggedvl.losses import RetrievalLoss, make_retrieval_loss
from raggedvl.models import LoraSettings, build_retriever
from raggedvl.parallel.runtime import DistInfo
from raggedvl.images import ImagePolicy
from raggedvl.sampling import BalancedDistributedBatchSampler, SampleCosts, estimate_costs
from raggedvl.train.config import TrainConfig


@dataclass
class Components:
    processor: Any
    train_set: Sequence[dict[str, Any]]
    eval_set: Sequence[dict[str, Any]]
    train_eval_set: Sequence[dict[str, Any]]
    collate: Callable[[list[dict[str, Any]]], dict[str, Any]]
    model: torch.nn.Module
    sampler: BalancedDistributedBatchSampler
    costs: SampleCosts  # the training split's size estimate (``costs.skipped``: pairs it rejected)
    loss: RetrievalLoss  # loss(queries, docs) on EmbeddingOutputs -> L_r


def prepare_data(cfg: TrainConfig) -> None:
    """Build and cache the processor (the tiny preset's tokenizer) and the embedded dataset,
    once, before the ranks start (each is a no-op when cached).

    Safe to call from several processes at once: a file lock serialises the dataset build."""
    build_processor(cfg.model, min_pixels=cfg.min_pixels, max_pixels=cfg.resolved_max_pixels, cache_dir=cfg.data_cache)
    if cfg.dataset != "rdocs":
        return
    root = cache_root(cfg.data_cache)
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / "rdocs.lock")):
        build_rdocs(root, train_limit=cfg.max_train_samples, dev_limit=cfg.max_eval_samples)


def load_splits(cfg: TrainConfig) -> tuple[Sequence[dict[str, Any]], Sequence[dict[str, Any]]]:
    if cfg.dataset == "rdocs":
        prepare_data(cfg)
        root = cache_root(cfg.data_cache)
        path = build_rdocs(root, train_limit=cfg.max_train_samples, dev_limit=cfg.max_eval_samples)
        return (
            load_retrieval_dataset(path, split=cfg.train_split, on_bad_image=cfg.on_bad_image),
            load_retrieval_dataset(path, split=cfg.eval_split, on_bad_image=cfg.on_bad_image),
        )
    train = load_retrieval_dataset(cfg.dataset, split=cfg.train_split, limit=cfg.max_train_samples, on_bad_image=cfg.on_bad_image)
    dev = load_retrieval_dataset(cfg.dataset, split=cfg.eval_split, limit=cfg.max_eval_samples, on_bad_image=cfg.on_bad_image)
    shared = set(train.ids()) & set(dev.ids())
    if shared:
        print(
            f"warning: {len(shared)} of the {len(dev)} evaluation pairs of {cfg.dataset!r} (split {cfg.eval_split!r}) are "
            f"also training pairs (split {cfg.train_split!r}): dev metrics measure memorisation, not generalisation. "
            "A single parquet file or image folder holds one split; point --dataset at a folder with a file per split.",
            file=sys.stderr,
        )
    return train, dev


def check_output_dir(cfg: TrainConfig) -> None:
    """Refuse to start a fresh run in a directory that holds another run's checkpoints (they
    would be mixed with this run's). Raises ``ValueError`` naming the fix."""
    from raggedvl.train.checkpoint import list_checkpoints

    found = list_checkpoints(Path(cfg.output_dir) / "checkpoints")
    if found and not cfg.resume:
        raise ValueError(
            f"{cfg.output_dir} already holds checkpoints of a run ({', '.join(p.name for p in found)}); "
            "pass --resume to continue it, or choose a new --output-dir"
        )


def estimate_train_costs(cfg: TrainConfig, train_set, policy: ImagePolicy) -> SampleCosts:
    """Per-pair costs and patch counts of the training split from image headers (no decoding),
    through the collator's own image ``policy``, so ``patches`` equal the collator's rows.
    Raises ``BadImageError`` naming the row under ``on_bad_image="error"``; under "skip" the
    rejected pairs are listed in ``SampleCosts.skipped`` (and later dropped by the collator)."""
    names = [train_set.row_name(i) for i in range(len(train_set))]
    return estimate_costs(train_set.image_inputs(), text_tokens=32, policy=policy,
                          on_bad_image=cfg.on_bad_image, names=names)


def make_sampler(cfg: TrainConfig, costs: SampleCosts, info: DistInfo) -> BalancedDistributedBatchSampler:
    n = len(costs.costs)
    if n < cfg.global_batch_size:
        raise ValueError(
            f"the training split has {n} pairs, fewer than global_batch_size {cfg.global_batch_size}; "
            f"lower --global-batch-size or use more data (--max-train-samples)"
        )
    if cfg.sampler == "equal":  # equal sample counts per rank, for comparison: all costs equal
        weights = [1.0] * n
    else:
        weights = costs.costs.tolist()
    return BalancedDistributedBatchSampler(
        weights, cfg.global_batch_size, info.world_size, info.rank, seed=cfg.seed,
        max_patches_per_rank=cfg.max_patches_per_rank, patches=costs.patches,
    )


def build_components(cfg: TrainConfig, info: DistInfo) -> Components:
    processor = build_processor(cfg.model, min_pixels=cfg.min_pixels, max_pixels=cfg.resolved_max_pixels, cache_dir=cfg.data_cache)
    train_set, eval_set = load_splits(cfg)
    costs = estimate_train_costs(cfg, train_set, ImagePolicy.from_processor(processor))  # before the model: bad pages fail fast
    lora = LoraSettings(r=cfg.lora_r, alpha=cfg.lora_alpha, dropout=cfg.lora_dropout) if cfg.use_lora else None
    model = build_retriever(
        cfg.model, processor=processor, head=cfg.head, dim=cfg.dim, pooling=cfg.pooling, lora=lora,
        attn_implementation=cfg.attn_implementation, gradient_checkpointing=cfg.gradient_checkpointing,
        seed=cfg.seed, merge_lora=not cfg.use_lora,
    )
    # the model's own prompts: a colpali / transformers checkpoint is fed as its library feeds it
    collate = RetrievalCollator(processor, max_length=cfg.max_length, on_bad_image=cfg.on_bad_image,
                                prompts=model.config.prompts)
    return Components(
        processor=processor,
        train_set=train_set,
        eval_set=eval_set,
        train_eval_set=Subset(train_set, range(min(cfg.eval_train_samples, len(train_set)))),
        collate=collate,
        model=model,
        sampler=make_sampler(cfg, costs, info),
        costs=costs,
        loss=make_retrieval_loss(cfg.loss, temperature=cfg.temperature),
    )

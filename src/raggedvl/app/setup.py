"""Build what a training run needs from its config: data, processor, model, sampler, loss.

Every rank calls :func:`build_components` with the same config and gets identical datasets
and an identical freshly initialised model (the seed is set by the caller); only the sampler
differs by rank.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
from filelock import FileLock

from raggedvl.data import RetrievalCollator, RetrievalDataset, build_processor, load_retrieval_dataset
from raggedvl.data.concat import concat_datasets
from raggedvl.data.splits import find_overlap, hash_split
from raggedvl.data.cache import cache_root
from raggedvl.evaluation.benchmark import RetrievalBenchmark, load_benchmark
from raggedvl.losses import RetrievalLoss, make_retrieval_loss
from raggedvl.models import LoraSettings, build_retriever
from raggedvl.parallel import DistInfo
from raggedvl.images import BadImageError, ImagePolicy
from raggedvl.sampling import BalancedDistributedBatchSampler, Mixture, SampleCosts, estimate_costs
from raggedvl.app.column_flags import flags_for_columns
from raggedvl.app.config import TrainConfig
from raggedvl.app.mixing import sources_mixture, training_sources
from raggedvl.app.wording import counted


@dataclass
class Components:
    processor: Any
    train_set: RetrievalDataset
    eval_set: RetrievalBenchmark | None  # None when the run does not evaluate
    train_eval_set: RetrievalBenchmark | None  # training pairs scored to show memorisation
    collate: Callable[[list[dict[str, Any]]], dict[str, Any]]
    model: torch.nn.Module
    sampler: BalancedDistributedBatchSampler
    costs: SampleCosts  # the training split's size estimate (``costs.skipped``: pairs it rejected)
    loss: RetrievalLoss  # loss(queries, docs) on EmbeddingOutputs -> L_r
    phases_s: dict[str, float]  # start-up seconds: data, cost_scan, model


def prepare_data(cfg: TrainConfig) -> None:
    """Build and cache the processor (the tiny preset's tokenizer) and the embedded dataset,
    once, before the ranks start (each is a no-op when cached).

    Safe to call from several processes at once: a file lock serialises the dataset build."""
    build_cfg_processor(cfg)
    if "rdocs" in cfg.datasets:
        _rdocs_source(cfg)


def _rdocs_source(cfg: TrainConfig) -> Path:
    """The embedded dataset's folder for ``cfg`` (built on first use under a file lock)."""
    root = cache_root(cfg.data_cache)
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / "rdocs.lock")):
        from raggedvl.data.rdocs import build_rdocs  # pypdfium2: only where the embedded data is built

        return build_rdocs(root, train_limit=cfg.max_train_samples, dev_limit=cfg.max_eval_samples)


def load_splits(cfg: TrainConfig, *, warn: bool = True,
                eval_flags: str = "eval_") -> tuple[RetrievalDataset, RetrievalBenchmark | None]:
    """The training pairs and the evaluation benchmark (None when the run does not evaluate).

    Several datasets (``cfg.datasets``) are each loaded (``max_train_samples`` per dataset) and
    concatenated in order (:func:`raggedvl.data.concat.concat_datasets`; ``make_sampler`` mixes
    them by ``dataset_weights``). Evaluation data, in order of precedence: ``eval_fraction`` (a
    content-hash split of each training split, held-out rows together), ``eval_dataset`` (its
    ``resolved_eval_split``: its one split, else ``eval_split``), else the first dataset's own ``eval_split``; a dataset without that split is
    a ``ValueError`` naming the two options. The evaluation pairs are read with ``cfg.eval_columns``;
    a missing column's message names ``--<eval_flags>query-column`` (``raggedvl eval``, whose
    flags are ``--query-column``..., passes "").
    Evaluation documents or queries that also occur in the training pairs (by content, see
    ``raggedvl.data.splits``) are refused (``ValueError``) unless ``allow_eval_overlap``, then
    reported as a warning; either way before any training or collective."""
    sources, trains, held = [], [], []
    for name in cfg.datasets:
        if name == "rdocs":
            source = _rdocs_source(cfg)
            train_limit = None  # the build already holds max_train_samples pairs
        else:
            source, train_limit = name, cfg.max_train_samples
        with flags_for_columns():
            train = load_retrieval_dataset(source, split=cfg.train_split, on_empty_query=cfg.on_empty_query,
                                           cache_dir=cfg.data_cache, columns=cfg.columns, on_bad_image=cfg.on_bad_image)
        if cfg.eval_fraction is not None:
            train, held_out = hash_split(train, cfg.eval_fraction)
            held.append(held_out)
        sources.append(source)
        trains.append(train.sample(train_limit))
    names = [str(s) for s in cfg.datasets]
    train = concat_datasets(trains, names)
    if cfg.eval_fraction is not None:
        held_out = concat_datasets(held, names)
        bench = RetrievalBenchmark.from_pairs(held_out.sample(cfg.max_eval_samples), name=f"{' + '.join(names)} (held out)")
    elif not cfg.evaluates:
        bench = None
    else:
        with flags_for_columns(eval_flags, keys=bool(eval_flags)):  # raggedvl eval: flags, no keys
            bench = load_benchmark(cfg.eval_dataset or sources[0], cfg.resolved_eval_split, limit=cfg.max_eval_samples,
                                   on_bad_image=cfg.on_bad_image, columns=cfg.eval_columns)
    if bench is not None:
        check_overlap(cfg, train, bench, warn=warn)
    return train, bench


def check_overlap(cfg: TrainConfig, train: RetrievalDataset, bench: RetrievalBenchmark, *, warn: bool = True) -> None:
    """Refuse (``ValueError``) or, with ``allow_eval_overlap``, warn about evaluation content
    that occurs in the training pairs."""
    overlap = find_overlap(train, bench.documents, bench.queries, bench.query_ids)
    if not overlap:
        return
    where = (f"the rows held out by --eval-fraction {cfg.eval_fraction}" if cfg.eval_fraction is not None else
             f"evaluation set {cfg.eval_dataset or cfg.datasets[0]!r} (split {cfg.resolved_eval_split!r})")
    if not cfg.allow_eval_overlap:
        raise ValueError(
            f"{where} overlaps the training pairs: {overlap.describe()}; dev metrics would measure memorisation. "
            "Evaluate on held-out data (--eval-dataset, --eval-split, --eval-fraction) or pass --allow-eval-overlap"
        )
    if warn:
        print(f"warning: {where} overlaps the training pairs (--allow-eval-overlap): {overlap.describe()}", file=sys.stderr, flush=True)


def check_model_checkpoint(cfg: TrainConfig) -> None:
    """Check ``cfg.model`` when it is a local colpali-engine / transformers checkpoint or adapter,
    from its JSON files and safetensors headers only (``raggedvl.models.interop.check_checkpoint``):
    a missing or misshapen projection or an adapter that does not fit its base is a
    ``ValueError`` naming the file and the tensor, in seconds, before torchrun starts any rank.
    A sharded raggedvl training checkpoint is verified against its manifest instead
    (``raggedvl.app.checkpoint.CheckpointError``)."""
    from raggedvl.models.interop import check_checkpoint
    from raggedvl.app.checkpoint import is_sharded, verify_checkpoint

    if is_sharded(cfg.model):
        verify_checkpoint(cfg.model)
        return
    check_checkpoint(cfg.model)


def negatives_label(k: int) -> str:
    """What a training row's image numbers mean in a bad-image message when it has ``k`` hard
    negatives: ``" (image 0: the document, image 1: its hard negative)"``, ``"..., images 1-3:
    its hard negatives)"``; empty without hard negatives (the row has one image)."""
    if k == 0:
        return ""
    negatives = "image 1: its hard negative" if k == 1 else f"images 1-{k}: its hard negatives"
    return f" (image 0: the document, {negatives})"


def estimate_train_costs(cfg: TrainConfig, train_set, policy: ImagePolicy) -> SampleCosts:
    """Per-pair costs and patch counts of the training split from image headers (no decoding),
    through the collator's own image ``policy``, so ``patches`` equal the collator's rows (a
    pair's document and its own hard negatives together, however many the row has). A row with
    several positives counts its first under ``positive_sampling="first"`` and its largest
    (most patch rows) under ``"random"``, a bound on whichever an epoch draws, so
    ``max_patches_per_rank`` holds every epoch.
    Raises ``BadImageError`` naming the row under ``on_bad_image="error"``; under "skip" the
    rejected pairs are listed in ``SampleCosts.skipped`` (and :func:`make_sampler` never draws them)."""
    negatives = train_set.negative_counts
    names = [train_set.row_name(i) + negatives_label(negatives[i]) for i in range(len(train_set))]
    choose = None
    if cfg.positive_sampling == "random":
        def choose(positives: list) -> object:  # the positive with the most patch rows
            best, most = positives[0], -1
            for positive in positives:
                try:
                    t, h, w = policy.inspect(positive).grid
                except BadImageError:
                    return positive  # estimate_costs names the row and applies on_bad_image
                if t * h * w > most:
                    best, most = positive, t * h * w
            return best
    return estimate_costs(train_set.image_inputs(choose), text_tokens=32, policy=policy,
                          on_bad_image=cfg.on_bad_image, names=names)


def make_sampler(cfg: TrainConfig, costs: SampleCosts, info: DistInfo,
                 dataset_sizes: list[int] | None = None,
                 row_sources: Sequence[str] | None = None) -> BalancedDistributedBatchSampler:
    """This rank's cost-balanced sampler over the pairs the size estimate kept (``costs.kept()``:
    a pair in ``costs.skipped`` is never drawn, so every step holds G readable pairs). Its
    sources (several datasets, rows in ``dataset_sizes`` concatenated in order, or the values of
    ``cfg.source_column``, one per row in ``row_sources``) and their weights come from
    :mod:`raggedvl.app.mixing`: with weights, or with ``cfg.batch_sampling == "one-source"``,
    the sampler draws them through a :class:`raggedvl.sampling.Mixture` over each source's kept
    rows. A pure function of the config and the data: every rank builds the same plan.
    Raises ``ValueError`` for fewer kept pairs than the global batch, bad weights (a source with
    a positive weight whose every pair was rejected among them), or a one-source source with a
    positive weight and fewer kept pairs than processes."""
    n_all = len(costs.costs)
    kept = costs.kept()
    n = len(kept)
    if n < cfg.global_batch_size:
        rejected = f" ({n_all - n} more rejected for unreadable images)" if n < n_all else ""
        raise ValueError(
            f"the training split has {counted(n, 'pair')}{rejected}, fewer than global_batch_size {cfg.global_batch_size}; "
            f"lower --global-batch-size or use more data (--max-train-samples)"
        )
    sources = training_sources(cfg, costs, dataset_sizes, row_sources)
    mixture = sources_mixture(cfg, sources)
    rows = kept if mixture is None else sources.positions  # a mixture sees its sources' rows source after source
    weights = [1.0] * n if cfg.sampler == "equal" else costs.costs[rows].tolist()  # equal: equal counts per rank
    return BalancedDistributedBatchSampler(
        weights, cfg.global_batch_size, info.world_size, info.rank, seed=cfg.seed,
        max_patches_per_rank=cfg.max_patches_per_rank, patches=costs.patches[rows], mixture=mixture,
        indices=None if np.array_equal(rows, np.arange(n_all)) else rows,
    )


def row_sources(cfg: TrainConfig, train_set: RetrievalDataset) -> list[str] | None:
    """Each training row's ``source_column`` value (None without ``cfg.source_column``)."""
    if cfg.source_column is None:
        return None
    return [record["source_value"] for record in train_set.records]


def training_pairs_text(cfg: TrainConfig, costs: SampleCosts, dataset_sizes: list[int] | None = None,
                        duplicates: tuple[int, int] = (0, 0), row_sources: Sequence[str] | None = None) -> str:
    """The start line's count of training pairs: the pairs the sampler draws from (those the
    size estimate kept), then in parentheses what the count leaves out or holds that is never
    drawn: pairs rejected for unreadable images, and each source (dataset of ``dataset_sizes``,
    or value of ``cfg.source_column``, one per row in ``row_sources``) given weight 0 (its kept
    pairs are counted, as a mixture's epoch is one draw per kept pair, but none of them is drawn).
    E.g. ``"56 training pairs (b.parquet: 16 of them at weight 0, never drawn)"``. ``duplicates``:
    the training set's repeated queries and repeated pairs (``RetrievalDataset.duplicates``),
    named when there are any."""
    n_all = len(costs.costs)
    kept = costs.kept()
    notes = []
    sources = training_sources(cfg, costs, dataset_sizes, row_sources)
    if sources is not None and sources.weights is not None:
        notes += [f"{name}: {size} of them at weight 0, never drawn"
                  for name, size, w in zip(sources.names, sources.kept, sources.weights) if w == 0]
    if len(kept) < n_all:
        notes.append(f"{n_all - len(kept)} more left out: image unreadable")
    queries, rows = duplicates
    if queries:
        notes.append(f"{queries} repeat an earlier pair's query, {rows} of them its page too"
                     + ("; their pages are masked, not negatives, for each other (--false-negatives mask)"
                        if cfg.false_negatives == "mask" else ""))
    return f"{len(kept)} training pairs" + (f" ({'; '.join(notes)})" if notes else "")


def sources_text(cfg: TrainConfig, mixture: Mixture | None) -> str | None:
    """The start line's account of the sources of one-source batches, or of a source column's
    values (in the order ``dataset_weights`` weighs them): each source with its kept pairs and
    probability, e.g. ``"one-source global batches from: a.parquet (6 pairs, p=0.545), b.parquet
    (5 pairs, p=0.455)"``; None otherwise."""
    if mixture is None or not (mixture.one_source or cfg.source_column is not None):
        return None
    parts = [f"{mixture.name(d)} ({counted(size, 'pair')}, p={w:.3g})"
             for d, (size, w) in enumerate(zip(mixture.sizes, mixture.weights))]
    return f"{'one-source' if mixture.one_source else 'mixed'} global batches from: " + ", ".join(parts)


def build_model(cfg: TrainConfig, processor: Any) -> torch.nn.Module:
    """The retriever of ``cfg`` (fresh weights, seeded by ``cfg.seed``), its prompts with
    ``cfg.query_prefix`` / ``cfg.padding_side`` applied (they travel with the saved model)."""
    from raggedvl.app.checkpoint import as_retriever_folder

    lora = LoraSettings(r=cfg.lora_r, alpha=cfg.lora_alpha, dropout=cfg.lora_dropout) if cfg.use_lora else None
    with as_retriever_folder(cfg.model) as model_source:  # a sharded training checkpoint: consolidated here
        model = build_retriever(
            model_source, processor=processor, head=cfg.head,
            dim=cfg.dim, pooling=cfg.pooling, lora=lora, attn_implementation=cfg.attn_implementation,
            gradient_checkpointing=cfg.gradient_checkpointing, packing=cfg.packing, seed=cfg.seed,
            merge_lora=not cfg.use_lora,
        )
    model.config.prompts = model.config.prompts.with_overrides(cfg.query_prefix, cfg.padding_side)
    return model


def build_cfg_processor(cfg: TrainConfig) -> Any:
    return build_processor(cfg.model, min_pixels=cfg.min_pixels, max_pixels=cfg.resolved_max_pixels, cache_dir=cfg.data_cache)


@dataclass
class RunData:
    """What the launcher checks before any rank starts and a single-process run reuses:
    the processor, the training pairs, the evaluation benchmark and the training split's
    size estimate (``costs``), plus how long each took (``phases_s``: ``data``, ``cost_scan``)."""

    processor: Any
    train_set: RetrievalDataset
    eval_set: RetrievalBenchmark | None
    costs: SampleCosts
    phases_s: dict[str, float]


def prepare_run_data(cfg: TrainConfig, *, warn: bool = True) -> RunData:
    """Build the processor, open the data and check its columns, splits and overlap
    (:func:`load_splits`), and estimate the training split's costs from its image headers (a
    corrupt image is a ``BadImageError`` naming the row, the id, the file and
    ``--on-bad-image skip``). No collective. (What the names point at is checked before, by
    :func:`raggedvl.app.launch.check_names`, in the launching process.)"""
    t0 = time.perf_counter()
    processor = build_cfg_processor(cfg)
    train_set, eval_set = load_splits(cfg, warn=warn)
    t1 = time.perf_counter()
    costs = estimate_train_costs(cfg, train_set, ImagePolicy.from_processor(processor))
    return RunData(processor, train_set, eval_set, costs, {"data": t1 - t0, "cost_scan": time.perf_counter() - t1})


def build_components(cfg: TrainConfig, info: DistInfo, data: RunData | None = None) -> Components:
    """Everything a rank trains with; ``data`` from :func:`prepare_run_data` when the caller has
    it (a single-process run reuses the launcher's), else prepared here. ``Components.phases_s``
    adds ``model`` (seconds to build the retriever)."""
    data = data or prepare_run_data(cfg, warn=info.is_main)
    train_set = data.train_set
    train_eval = train_set.select(range(min(cfg.eval_train_samples, len(train_set))))
    train_eval_set = (RetrievalBenchmark.from_pairs(train_eval, name="training pairs")
                      if data.eval_set is not None and len(train_eval) else None)
    t0 = time.perf_counter()
    model = build_model(cfg, data.processor)
    phases = {**data.phases_s, "model": time.perf_counter() - t0}
    # the model's own prompts: a colpali / transformers checkpoint is fed as its library feeds it
    collate = RetrievalCollator(data.processor, max_length=cfg.max_length, on_bad_image=cfg.on_bad_image,
                                prompts=model.config.prompts, layout=model.family.name)
    return Components(
        processor=data.processor,
        train_set=train_set,
        eval_set=data.eval_set,
        train_eval_set=train_eval_set,
        collate=collate,
        model=model,
        sampler=make_sampler(cfg, data.costs, info, train_set.part_sizes, row_sources(cfg, train_set)),
        costs=data.costs,
        loss=make_retrieval_loss(cfg.loss, temperature=cfg.temperature),
        phases_s=phases,
    )

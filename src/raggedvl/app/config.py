"""Typed configuration of ``raggedvl train`` (validated at construction).

The defaults are the embedded default job: the tiny preset on the rdocs pairs with its
recipe (lr 2e-4 for the backbone and 2e-3 for the head, 600 steps, global batch 8, temperature
0.02, ``TINY_TRAIN_MAX_PIXELS`` per page; docs/tiny-model.md says why). For a pretrained checkpoint start from
``configs/qwen2-vl-2b.yaml`` (ColPali's recipe: LoRA r=32, lr 5e-5, global batch 32).

Precedence: dataclass defaults (the embedded default job) < YAML file (``--config``) <
command-line flags. Every field is a flag: ``global_batch_size`` is ``--global-batch-size``.
Each field is declared once with :func:`raggedvl.app.options.option` (help text with units, bounds;
``Literal`` types list the choices): ``raggedvl train --help`` and the checks come from there.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal

from raggedvl.data.columns import Columns
from raggedvl.data.tiny_limits import TINY_MIN_PIXELS, TINY_TRAIN_MAX_PIXELS
from raggedvl.models.head_options import DEFAULT_DIM, DEFAULT_HEAD, DEFAULT_POOLING
from raggedvl.app.options import (add_arguments, check_fields, check_given, check_known_keys, load_yaml, option,
                                  field_specs, values_from)
from raggedvl.app.wording import counted

DEFAULT_WARMUP_STEPS = 10  # the warmup of a run of 100 steps or more when --warmup-steps is not given


def default_warmup_steps(total_steps: int) -> int:
    """The warmup of a run of ``total_steps`` optimizer steps without ``--warmup-steps``:
    min(10, ceil(10 % of the steps)), at most ``total_steps - 2`` (a warmup that ends at the last
    step leaves no decay), at least 0."""
    return max(0, min(DEFAULT_WARMUP_STEPS, math.ceil(0.1 * total_steps), total_steps - 2))

# A run directory's training config. Not "config.json": transformers (ColQwen2ForRetrieval.from_pretrained)
# would read that as a model config and build its default 80-layer model from unknown keys.
TRAIN_CONFIG_NAME = "train_config.json"
FINEST_RESIZE_FACTOR = 28  # the smallest patch_size * merge_size of the families (Qwen2-VL: 14 * 2; Qwen3-VL: 32)


def check_pixel_limits(min_pixels: int | None, max_pixels: int | None, model: str | None,
                       name: Callable[[str], str] = str) -> None:
    """Raise ``ValueError`` when no image fits the resize limits, as far as they are known before
    the processor loads (null: not known): ``max_pixels`` under ``2 * factor**2`` pixels, the
    image processor's floor (:class:`raggedvl.images.ImagePolicy`; ``factor = patch_size *
    merge_size``, at least ``FINEST_RESIZE_FACTOR`` in every family), or under ``min_pixels`` (given, or the tiny preset's
    ``TINY_MIN_PIXELS``; a checkpoint's own is known only once loaded). ``name(key)`` is how the
    message names a setting: its flag or its config key."""
    if max_pixels is None:
        return
    factor = FINEST_RESIZE_FACTOR
    floor = 2 * factor * factor
    if max_pixels < floor:
        raise ValueError(f"{name('max_pixels')} must be >= {floor} (2 * {factor}**2: the smallest resized image of "
                         f"any supported model), got {max_pixels}")
    lowest = f"{name('min_pixels')} {min_pixels}"
    if min_pixels is None and model == "tiny":
        min_pixels, lowest = TINY_MIN_PIXELS, f"the tiny model's min_pixels {TINY_MIN_PIXELS}"
    if min_pixels is not None and max_pixels < min_pixels:
        raise ValueError(f"{name('max_pixels')} {max_pixels} is below {lowest}: no image fits; raise "
                         f"{name('max_pixels')} to at least {min_pixels} or lower {name('min_pixels')}")


@dataclass
class TrainConfig:
    # model
    model: str = option("tiny", "backbone: 'tiny' (built from a config, no download), a hub id or a local directory; "
                                "also a colpali-engine or transformers ColQwen2 checkpoint or LoRA adapter")
    head: Literal["late_interaction", "bi_encoder"] = option(
        DEFAULT_HEAD, "embedding head: ColQwen-style multi-vector (late_interaction) or one vector (bi_encoder)")
    pooling: Literal["last", "mean"] = option(DEFAULT_POOLING, "bi-encoder pooling over the last hidden states")
    dim: int = option(DEFAULT_DIM, "embedding dimension of the projection head", at_least=1)
    lora: bool | None = option(None, "train LoRA adapters on the language model (none: yes for pretrained "
                                     "checkpoints, full training for 'tiny'); a LoRA adapter given as --model "
                                     "keeps its own r/alpha/dropout, and false merges it into its base")
    lora_r: int = option(32, "LoRA rank (inner dimension of the adapters)", at_least=1)
    lora_alpha: int = option(32, "LoRA alpha (the update is scaled by alpha / r)", at_least=1)
    lora_dropout: float = option(0.1, "LoRA dropout probability", at_least=0, below=1)
    gradient_checkpointing: bool = option(False, "recompute the backbone's activations in backward (less memory)")
    attn_implementation: str | None = option(
        None, "transformers attention implementation, e.g. sdpa, eager, flash_attention_2 (none: sdpa)")
    packing: bool = option(
        False, "padding-free sequences: each encode call packs its samples into one token row with per-sample "
               "M-RoPE positions and per-sequence attention (same embeddings and losses, no padding tokens)")
    rebalance_vision: bool = option(
        False, "encoder rebalancing: a rank whose vision-tower work (patches + patches**2/8192 per image) exceeds "
               "max(mean, largest image) hands whole images to less loaded ranks for the tower only (all-to-all, "
               "features and gradients come back; same losses and gradients); multi-process runs without grad_cache")
    # data
    dataset: str | list[str] = option(
        "rdocs", "training data: 'rdocs' (embedded), a hub id, a local parquet file or image folder; several "
                 "(YAML: a list) are mixed by dataset_weights")
    dataset_weights: list[float] | None = option(
        None, "sampling weight of each source: of each dataset, in the order given, or with source_column of each "
              "value of that column, in sorted order (the start line lists them) (normalised to sum 1; a global batch "
              "draws each sample's source, or with batch_sampling one-source its one source, with these "
              "probabilities, seeded; none: every row equally likely; 0: the source is loaded and counts in an "
              "epoch's length but is never drawn, as the start line says)", at_least=0)
    batch_sampling: Literal["mixed", "one-source"] = option(
        "mixed", "how a global batch draws its sources: each sample by the weights (mixed), or one source per global "
                 "batch, chosen by the weights (none given: in proportion to each source's rows), every sample of the "
                 "step from it, so in-batch negatives share the query's source; metrics.jsonl names each step's "
                 "source (one-source); the sources are the datasets, or source_column's values")
    source_column: str | None = option(
        None, "column of the (one) training dataset whose values name each row's source (rows with equal values "
              "form one source), used by batch_sampling one-source and by dataset_weights (mixed batches without "
              "dataset_weights draw every row alike); an rdocs manifest key works too (none: each dataset is a "
              "source)")
    train_split: str = option("train", "dataset split to train on")
    eval_split: str = option(
        "dev", "split to evaluate on (of eval_dataset when given, else of dataset); dev and validation find each other; "
               "an eval_dataset of one split (a parquet file, a folder of one split's files) is evaluated on that "
               "split, whatever its name")
    eval_dataset: str | None = option(
        None, "evaluation set when it is not a split of dataset: hub id, local folder or parquet file of (query, image) "
              "pairs, or a BEIR folder (corpus*, queries*, qrels*) (none: dataset)")
    eval_fraction: float | None = option(
        None, "hold out this share of the training split for evaluation, by a hash of each image's bytes "
              "(none: evaluate on eval_split)", above=0, below=1)
    query_column: str = option("query", "column of the training pairs holding the query text")
    image_column: str = option("image", "column of the training pairs holding the document image (datasets Image "
                                        "feature, or file paths), or a list of them: the query's positives")
    id_column: str | None = option(None, "column of the training pairs holding each row's id, used in messages and "
                                         "reports (none: an image folder's file paths, else '<split>-<row>')")
    eval_query_column: str | None = option(
        None, "column of the evaluation pairs (eval_dataset, or dataset's eval_split) holding the query text "
              "(none: query_column)")
    eval_image_column: str | None = option(
        None, "column of the evaluation pairs holding the document image (none: image_column)")
    eval_id_column: str | None = option(None, "column of the evaluation pairs holding each row's id (none: id_column; "
                                              "'': no id column, as id_column none)")
    negatives_column: str | None = option(
        None, "column holding each row's hard negatives: one image, or a list of any length (0 included; rows "
              "differ, nothing is padded); each is encoded as a document and is a candidate for every query of the "
              "global batch (none: in-batch negatives only)")
    positive_sampling: Literal["first", "random"] = option(
        "first", "which positive a query trains against in an epoch when its image column holds a list: the first, "
                 "or one drawn from (seed, epoch, row), the same after --resume; all its positives are masked from "
                 "its candidates either way (with false_negatives mask)")
    on_empty_query: Literal["error", "skip"] = option(
        "error", "a training row whose query is empty or not text stops the run (error) or is left out and "
                 "counted (skip)")
    allow_eval_overlap: bool = option(
        False, "train even when evaluation documents (same image bytes) or queries (same text) occur in training pairs")
    max_train_samples: int | None = option(
        256, "training pairs used (rdocs: also built), in samples (none: all; rdocs has ~1,300)", at_least=1)
    max_eval_samples: int | None = option(128, "evaluation pairs used, in samples (none: all)", at_least=1)
    min_pixels: int | None = option(None, "smallest image area after resize, in pixels (none: the processor's)",
                                    at_least=1)
    max_pixels: int | None = option(
        None, "largest image area after resize, in pixels (none: 100352 for 'tiny', else the checkpoint's)",
        at_least=1)
    max_length: int | None = option(
        None, "token cap per sample; never cuts through image placeholders (none: no cap)", at_least=1)
    query_prefix: str | None = option(
        None, "text written before every query, replacing the model's own prefix (none: the model's prompts; a "
              "colpali-engine checkpoint has none, raggedvl < 0.2 wrote 'Query: '); saved with the trained model")
    padding_side: Literal["left", "right"] | None = option(
        None, "where the collator pads queries and documents (none: the model's prompts; colpali-engine pads on the "
              "left); saved with the trained model")
    data_workers: int | None = option(
        None, "worker processes that read and collate the next batches while the model trains (0: collate in the "
              "training process; none: 1 on CUDA, and on CPU where each rank on the node keeps its compute threads "
              "and its worker still gets a core of its own, else 0); batches are pinned for the GPU copy on CUDA", at_least=0)
    on_bad_image: Literal["error", "skip"] = option(
        "error", "an unreadable image stops the run (error) or is skipped and counted in the summary (skip: a pair "
                 "whose image header is unreadable is left out of the sampler's plan at startup)")
    # objective
    loss: Literal["late_interaction", "pairwise", "infonce"] = option(
        "late_interaction", "contrastive loss: late_interaction or pairwise (multi-vector head), infonce (bi-encoder)")
    temperature: float = option(0.02, "softmax temperature: logits = score / temperature", above=0)
    false_negatives: Literal["mask", "keep"] = option(
        "mask", "a candidate page that is one of the query's own pages (the same stored image as one of its "
                "positives, or a page of another query with the same text; on any rank) is removed from the query's softmax "
                "(mask) or kept as a negative (keep); metrics.jsonl counts the masked pairs per step")
    # optimisation
    global_batch_size: int = option(
        8, "samples per optimizer step over all ranks (the in-batch negatives pool)", at_least=1)
    max_patches_per_rank: int | None = option(
        None, "cap on the image patch rows (pixel_values rows, after resizing) one rank encodes per step; a "
              "global batch that does not fit is split into more steps (none: no cap)", at_least=1)
    epochs: int = option(1, "passes over the training set (when max_steps is none)", at_least=1)
    max_steps: int | None = option(600, "optimizer steps; overrides epochs (none: train `epochs` epochs)", at_least=1)
    lr: float = option(2e-4, "AdamW peak learning rate of the backbone (linear warmup, then lr_schedule's decay)", above=0)
    head_lr: float | None = option(2e-3, "peak learning rate of the projection head (none: same as lr)", above=0)
    weight_decay: float = option(0.0, "AdamW weight decay", at_least=0)
    warmup_steps: int | None = option(
        None, "linear warmup, in optimizer steps (none: 10, or about 10 % of a shorter run's steps, leaving at least "
              "one step of decay); a given value above the run's steps - 1 is cut to steps - 1 with a warning (the lr "
              "then peaks only at the last step, with no decay)", at_least=0)
    lr_schedule: Literal["cosine", "linear"] = option(
        "cosine", "decay after the warmup, to 0 at the last step: cosine or linear (the HF Trainer's and colpali-engine's "
                  "default); the first step runs at lr 0 with any warmup, as in transformers")
    max_grad_norm: float = option(1.0, "gradient clipping threshold on the global L2 norm (0: no clipping)", at_least=0)
    checkpoint_on_signal: bool = option(
        True, "on SIGTERM or SIGUSR1 (a cluster's preemption) finish the step, write a checkpoint and exit with "
              "code 3; false: exit after the step without saving")
    preemption_grace_s: float = option(
        600.0, "seconds after SIGTERM / SIGUSR1 within which a checkpoint is still written (past it the run "
               "stops without saving, saying so); set below your scheduler's grace period", above=0)
    max_nonfinite_steps: int = option(
        3, "a step whose gradient norm is NaN or infinite is not applied (optimizer and schedule skip it, "
           "metrics.jsonl marks it nonfinite); this many such steps in a row stop the run", at_least=1)
    sampler: Literal["balanced", "equal"] = option(
        "balanced", "how a global batch is split over ranks: by cost (balanced) or equal sample counts (equal)")
    seed: int = option(0, "seed of model init, sampler order and dropout")
    precision: Literal["auto", "bf16", "fp32"] = option(
        "auto", "auto: bf16 autocast on CUDA, fp32 on CPU; bf16: autocast also on CPU; fp32: none")
    strategy: Literal["ddp", "fsdp2", "hsdp"] = option(
        "ddp", "data parallelism: DDP, FSDP2 (fully_shard over all ranks) or HSDP (FSDP2 sharded within groups of "
               "shard_degree ranks, replicated across the groups)")
    shard_degree: int | None = option(
        None, "HSDP: ranks that share one sharded copy of the model, e.g. the GPUs of a node; must divide the number "
              "of processes (only with strategy hsdp, where it is required)", at_least=1)
    grad_cache: bool = option(False, "GradCache: embed in chunks, so memory does not grow with the global batch")
    grad_cache_budget: int = option(4096, "GradCache chunk size, in patches + tokens per chunk", at_least=1)
    collapse_patience: int = option(
        5, "warn (one line, with likely causes) when the training loss has sat at its chance value, where every "
           "document scores the same (ln(pairs + hard negatives) of the step; ln 2 for the pairwise loss), for this many steps in a row "
           "(0: no check)", at_least=0)
    stop_on_collapse: bool = option(
        False, "stop the run (final checkpoint and report written) when the collapse check fires")
    # run
    output_dir: str = option("runs/default", "run directory: checkpoints, metrics.jsonl, summary.md, report.png; "
                                             "with --resume its train_config.json gives the settings flags do not")
    checkpoint_every: int = option(50, "checkpoint interval, in optimizer steps (a final one is always written)",
                                   at_least=1)
    keep_checkpoints: int = option(2, "newest checkpoints kept on disk", at_least=1)
    async_checkpoint: bool = option(
        False, "write checkpoints in the background: each rank copies its shards to host memory (pinned on CUDA) "
               "and training continues while a thread writes them; at most one in flight, completed (hashes, "
               "manifest, rename) before the next save and at the end; a failure stops the run naming its step")
    log_every: int = option(1, "metrics interval, in optimizer steps", at_least=1)
    progress_every: int = option(
        10, "when stderr is not a terminal (a log file, a pipe), one plain progress line every this many optimizer "
            "steps (on a terminal: a progress bar)", at_least=1)
    report_to: str = option(
        "none", "experiment trackers, comma-separated: tensorboard (event files in <output_dir>/tensorboard), wandb, "
                "mlflow; each needs its extra, e.g. pip install 'raggedvl[tensorboard]' (none: no tracker)")
    eval_before: bool = option(True, "evaluate before training (nDCG@1/3/5/10, Recall@1/5/10, MRR@10, MAP@10)")
    eval_after: bool = option(True, "evaluate after training")
    eval_train_samples: int = option(128, "training pairs also scored at evaluation, to show memorisation",
                                     at_least=0)
    eval_batch_size: int = option(16, "samples per forward pass at evaluation", at_least=1)
    save_best: Literal["ndcg@1", "ndcg@3", "ndcg@5", "ndcg@10", "recall@1", "recall@5", "recall@10", "mrr@10",
                       "map@10"] | None = option(
        None, "evaluate every checkpoint_every steps and keep the weights with the best dev value of this metric "
              "in <output_dir>/best (none: off)")
    resume: bool = option(False, "continue from the newest valid checkpoint in output_dir")
    collective_timeout_s: int = option(300, "every collective fails after this many seconds", at_least=1)
    data_cache: str | None = option(None, "where built datasets are cached (none: $RAGGEDVL_CACHE when set, else "
                                          "~/.cache/raggedvl)")

    def __post_init__(self) -> None:
        if isinstance(self.dataset, (list, tuple)) and len(self.dataset) == 1:
            self.dataset = self.dataset[0]  # one --dataset flag: the plain name
        check_fields(self)
        if not self.output_dir.strip():
            raise ValueError("output_dir is empty: it would write the run into the current folder; name the run "
                             "directory (--output-dir runs/NAME)")
        if isinstance(self.dataset, (list, tuple)):
            self.dataset = list(self.dataset)
        if self.dataset_weights is not None:
            weights = self.dataset_weights
            if len(weights) != len(self.datasets) and self.source_column is None:
                raise ValueError(
                    f"dataset_weights has {counted(len(weights), 'value')} {weights} for "
                    f"{counted(len(self.datasets), 'dataset')} "
                    f"{self.datasets}; give one weight per dataset, in order (--dataset-weights 0.7,0.3)")
            if not any(w > 0 for w in weights):
                raise ValueError(f"dataset_weights {weights} are all 0; give at least one source a positive weight")
        self._check_sources()
        check_pixel_limits(self.min_pixels, self.max_pixels, self.model)
        from raggedvl.app.tracking import parse_report_to

        parse_report_to(self.report_to)
        if self.eval_fraction is not None and self.eval_dataset is not None:
            raise ValueError("eval_fraction holds out part of dataset; it cannot be combined with eval_dataset")
        if self.strategy == "hsdp" and self.shard_degree is None:
            raise ValueError("strategy 'hsdp' needs shard_degree (--shard-degree K: ranks per shard group, e.g. the "
                             "GPUs of a node)")
        if self.strategy != "hsdp" and self.shard_degree is not None:
            raise ValueError(f"shard_degree {self.shard_degree} applies to strategy 'hsdp' only, got strategy "
                             f"{self.strategy!r}; drop it or use --strategy hsdp")
        if self.rebalance_vision and self.grad_cache:
            raise ValueError("rebalance_vision does not work with grad_cache (ranks may encode different numbers of "
                             "chunks, and rebalancing is a collective in every encode): turn one of them off")
        if (self.head == "bi_encoder") != (self.loss == "infonce"):
            raise ValueError(
                f"head={self.head!r} does not go with loss={self.loss!r}: use loss='infonce' with the "
                "bi-encoder head, and 'late_interaction' or 'pairwise' with the multi-vector head"
            )

    def _check_sources(self) -> None:
        """Refuse source settings that do not go together (one line each, with the fix). The
        number of ``dataset_weights`` for a ``source_column`` is checked against the column's
        values when the data is read (:meth:`check_source_weights`)."""
        if self.source_column is not None and len(self.datasets) > 1:
            raise ValueError(f"source_column {self.source_column!r} splits one dataset into sources, but "
                             f"{len(self.datasets)} datasets are given (each of them is a source): give one "
                             "--dataset, or leave out --source-column")
        if self.batch_sampling == "one-source" and self.source_column is None and len(self.datasets) < 2:
            raise ValueError("batch_sampling 'one-source' draws each global batch from one of several sources: "
                             "give several --dataset, or --source-column naming a column of the dataset")

    def check_source_weights(self, names: list[str], rows: list[int]) -> None:
        """Raise ``ValueError`` when ``dataset_weights`` does not give one weight per value of
        ``source_column`` (``names``: the values, sorted; ``rows``: each value's rows), naming the
        values in order with their rows."""
        if self.dataset_weights is not None and len(self.dataset_weights) != len(names):
            listed = ", ".join(f"{name!r} ({counted(r, 'row')})" for name, r in zip(names, rows))
            values = counted(len(self.dataset_weights), "value")
            raise ValueError(f"dataset_weights has {values} {self.dataset_weights} for the "
                             f"{counted(len(names), 'value')} of source column {self.source_column!r}: {listed}; give one "
                             "weight per value, in this order (0: never drawn)")

    @property
    def datasets(self) -> list[str]:
        """The training datasets, in order (one for a plain ``dataset``)."""
        return list(self.dataset) if isinstance(self.dataset, list) else [self.dataset]

    @property
    def columns(self) -> Columns:
        """The training pairs' columns."""
        return Columns(query=self.query_column, image=self.image_column, id=self.id_column,
                       negatives=self.negatives_column, source=self.source_column)

    @property
    def eval_columns(self) -> Columns:
        """The evaluation pairs' columns: each ``eval_*`` key, else the training one's (an
        ``eval_id_column`` of ``""``: no id column)."""
        return Columns(query=self.eval_query_column or self.query_column,
                       image=self.eval_image_column or self.image_column,
                       id=(self.eval_id_column or None) if self.eval_id_column is not None else self.id_column)

    @property
    def resolved_eval_split(self) -> str:
        """The split evaluation reads: an ``eval_dataset`` of one split (a ``.parquet`` file, a
        folder whose files make one split) is the evaluation set, so its one split whatever its
        name (:meth:`raggedvl.data.source.DataSource.default_split`), under the name ``eval_split``
        gives it when that is an alias (``dev`` for ``dev.parquet``'s "validation"); else
        ``eval_split`` (the dev*/test* file-name rules of a folder of several splits). Reads
        folder entries only."""
        if self.eval_dataset is None or self.eval_fraction is not None:
            return self.eval_split
        from raggedvl.data.scan import SPLIT_ALIASES
        from raggedvl.data.source import DataSource

        only = DataSource.of(self.eval_dataset).default_split(self.eval_split)
        alias = any(only in names and self.eval_split in names for names in SPLIT_ALIASES)
        return self.eval_split if alias else only

    @property
    def resolved_max_pixels(self) -> int | None:
        """``max_pixels``, or ``TINY_TRAIN_MAX_PIXELS`` for the tiny preset when not given."""
        if self.max_pixels is None and self.model == "tiny":
            return TINY_TRAIN_MAX_PIXELS
        return self.max_pixels

    def resolved_warmup_steps(self, total_steps: int) -> int:
        """The warmup a run of ``total_steps`` optimizer steps uses: ``warmup_steps`` cut to
        ``total_steps - 1``, or :func:`default_warmup_steps` when not given."""
        if self.warmup_steps is not None:
            return min(self.warmup_steps, max(0, total_steps - 1))
        return default_warmup_steps(total_steps)

    @property
    def evaluates(self) -> bool:
        """Whether the run reads an evaluation set: ``eval_before``, ``eval_after`` or ``save_best``."""
        return self.eval_before or self.eval_after or self.save_best is not None

    @property
    def use_lora(self) -> bool:
        return self.lora if self.lora is not None else self.model != "tiny"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "TrainConfig":
        """Raises ``ValueError`` for an unknown key (with the closest known one) or a value of the
        wrong type (a quoted ``"false"`` is a string, not a boolean), naming the key."""
        check_known_keys(cls, values)
        return cls(**values)

    @classmethod
    def from_yaml(cls, path: str | Path, overrides: dict[str, Any] | None = None) -> "TrainConfig":
        """The YAML file's keys, then ``overrides``; numbers in any notation (``1e-4``) are numbers."""
        values = load_yaml(path)
        values.update(overrides or {})
        return cls.from_dict(values)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n", encoding="utf-8")


def add_config_arguments(parser) -> None:
    """Add one ``--flag`` per config field to an argparse parser (absent unless given;
    ``none`` sets an optional field to None; booleans are also bare flags, ``--no-X`` for false)."""
    add_arguments(parser, TrainConfig)


def config_from_args(args) -> TrainConfig:
    """Defaults < ``--config`` YAML < flags that were given. With ``--resume`` and no
    ``--config``, the run's own settings (``<output_dir>/train_config.json``) take the place of
    the defaults, so ``raggedvl train --output-dir RUN --resume`` continues the run as it was
    started; flags given still override them (and the resume check refuses what a checkpoint
    cannot continue with)."""
    overrides = values_from(args, TrainConfig)
    check_given(TrainConfig, overrides)  # a flag's bad value names the flag; the YAML's, its key
    specs = field_specs(TrainConfig)
    from_file = getattr(args, "config", None) or overrides.get("resume")  # the model may come from a file
    model = overrides.get("model", None if from_file else TrainConfig.model)
    check_pixel_limits(overrides.get("min_pixels"), overrides.get("max_pixels"), model, lambda key: specs[key].flag)
    if getattr(args, "config", None):
        return TrainConfig.from_yaml(args.config, overrides)
    if overrides.get("resume"):
        output_dir = overrides.get("output_dir", TrainConfig.output_dir)
        saved = Path(output_dir).expanduser() / TRAIN_CONFIG_NAME
        if saved.is_file():
            try:
                values = json.loads(saved.read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                raise ValueError(f"{saved} cannot be read ({exc}); pass the run's settings as flags or --config") from None
            known = {f.name for f in dataclasses.fields(TrainConfig)}
            values = {k: v for k, v in values.items() if k in known}
            return TrainConfig.from_dict({**values, "output_dir": output_dir, **overrides})
    return TrainConfig.from_dict(overrides)


def run_config(checkpoint: str | Path) -> TrainConfig | None:
    """The settings of the raggedvl run a checkpoint argument names, from JSON files only (no
    checkpoint verified or loaded): a run folder's ``train_config.json``, a checkpoint folder's
    ``trainer_state.json`` ``config`` (``run/checkpoints/step-N``, or one outside its run); None
    for anything else (a model folder, a hub id, a preset) or settings this version cannot read."""
    path = Path(checkpoint).expanduser()
    try:
        if (path / TRAIN_CONFIG_NAME).is_file():
            values = json.loads((path / TRAIN_CONFIG_NAME).read_text(encoding="utf-8"))
        elif (path / "trainer_state.json").is_file():
            values = json.loads((path / "trainer_state.json").read_text(encoding="utf-8"))["config"]
        else:
            return None
        known = {f.name for f in dataclasses.fields(TrainConfig)}
        return TrainConfig.from_dict({k: v for k, v in values.items() if k in known})
    except (OSError, ValueError, KeyError, TypeError):
        return None

"""The options of ``raggedvl eval | encode | search | export | data``, declared once each as
:func:`raggedvl.app.options.option` fields like ``TrainConfig``'s: flags, help, choices and
checks are derived from them (:func:`raggedvl.app.options.add_arguments`).

The column options are declared once: :class:`DocumentColumnOptions` for ``encode`` (documents
only), :class:`ColumnOptions` (with the query column) for the commands that read (query, image) rows."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from raggedvl.app.options import check_given, option, values_from
from raggedvl.data.columns import Columns

_NPROC = "processes to shard the work over (raggedvl starts torchrun)"
# eval options that --mteb replaces: mteb reads its task's data, on one process
_MTEB_EXCLUSIVE = ("dataset", "split", "max_samples", "query_column", "image_column", "id_column", "nproc_per_node")


@dataclass
class DocumentColumnOptions:
    """Which columns of document rows hold the image and the id; a BEIR layout names its own."""

    image_column: str | None = option(None, "column of the --dataset rows holding the document image "
                                            "(none: eval / mine of a raggedvl run: the run's (eval: its evaluation "
                                            "columns), else image)")
    id_column: str | None = option(None, "column of the --dataset rows holding each row's id (none: eval / mine of a "
                                         "raggedvl run: the run's; else no id column. '': no id column, even where "
                                         "the run has one. Without one: an image folder's file paths, else "
                                         "'<split>-<row>')")

    def columns(self) -> Columns:
        """The columns given, documents only (no query column); unset: ``image``, no id column
        (an id column of ``""``: none)."""
        return Columns(query=None, image=self.image_column or "image", id=self.id_column or None)


@dataclass
class ColumnOptions(DocumentColumnOptions):
    """Which columns of (query, image) rows hold what; a BEIR layout names its own."""

    query_column: str | None = option(None, "column of the --dataset rows holding the query text "
                                            "(none: eval / mine of a raggedvl run: the run's (eval: its evaluation "
                                            "columns), else query)")

    def columns(self) -> Columns:
        """The columns given; unset names are the defaults ``query`` / ``image``, no id column."""
        return dataclasses.replace(super().columns(), query=self.query_column or "query")


@dataclass
class EvalOptions(ColumnOptions):
    dataset: str | None = option(None, "benchmark: (query, image) pairs (parquet file, folder, hub id) or a BEIR layout "
                                       "(corpus*/queries*/qrels*, or hub configs) (none: the run's own evaluation split)")
    split: str | None = option(None, "split (none: the run's eval split; with --dataset: its one split, else test)")
    batch_size: int = option(16, "samples per forward pass", at_least=1)
    max_samples: int | None = option(None, "at most this many pairs (BEIR: queries, over the whole corpus) "
                                           "(none: all)", at_least=1)
    output: str | None = option(None, "results JSON file (none: RUN/eval/DATASET-SPLIT.json, or "
                                      "MODEL_FOLDER/eval/DATASET-SPLIT.json)")
    on_bad_image: Literal["error", "skip"] = option(
        "error", "an unreadable document image stops (error) or is never retrieved and counted (skip)")
    nproc_per_node: str | None = option(None, _NPROC + " (none: 1)")
    mteb: list[str] | None = option(None, "score with mteb's own evaluator on this mteb task or benchmark instead of "
                                          "--dataset (e.g. VidoreArxivQARetrieval, ViDoRe(v3)); prints mteb's main "
                                          "scores; offline, the task's data must be in the Hugging Face cache")

    def check_mteb(self) -> None:
        """With ``--mteb``, no option of raggedvl's own benchmark or of torchrun (mteb reads its
        task's data, on one process). Raises ``ValueError`` naming the flags."""
        given = [f"--{name.replace('_', '-')}" for name in _MTEB_EXCLUSIVE if getattr(self, name) is not None]
        if self.mteb and given:
            raise ValueError(f"--mteb scores on mteb's task data, on one process: drop {', '.join(given)}")


@dataclass
class EncodeOptions(DocumentColumnOptions):
    dataset: str = option(None, "documents: a folder of page images, a BEIR corpus, or the distinct images of "
                                "(query, image) rows", required=True)
    split: str | None = option(None, "split (none: the --dataset's one split, else test)")
    output: str = option(None, "a new (or empty) folder to write the index to", required=True)
    batch_size: int = option(8, "documents per forward pass", at_least=1)
    on_bad_image: Literal["error", "skip"] = option(
        "error", "an unreadable image stops (error) or is left out of the index and counted (skip)")
    nproc_per_node: str | None = option(None, _NPROC + " (none: 1)")


@dataclass
class MineOptions(ColumnOptions):
    dataset: str = option(None, "the training set: local (query, image) parquet pairs or a local BEIR folder "
                                "(corpus / queries / qrels)", required=True)
    split: str = option("train", "split")
    output: str = option(None, "a new folder to write the training set with its hard negatives to", required=True)
    k: int = option(4, "hard negatives per query", at_least=1, short="-k")
    max_positive_ratio: float = option(0.95, "drop a candidate scoring at least this fraction of the query's lowest "
                                             "positive score (a likely unlabelled positive; NV-Retriever's TopK-PercPos)",
                                       above=0)
    skip_top: int = option(0, "drop this many of the best candidates left after the positives", at_least=0)
    batch_size: int = option(16, "samples per forward pass", at_least=1)
    on_bad_image: Literal["error", "skip"] = option(
        "error", "an unreadable image stops (error) or is never mined and counted (skip)")
    nproc_per_node: str | None = option(None, _NPROC + " (none: 1)")


@dataclass
class SearchOptions:
    index: str = option(None, "index folder written by raggedvl encode", required=True)
    query: list[str] = option(None, "query text", required=True)
    k: int = option(10, "results per query", at_least=1, short="-k")
    chunk_size: int = option(1024, "documents scored at once; bounds memory", at_least=1)
    allow_other_model: bool = option(False, "search an index that another checkpoint (or step) encoded; its scores "
                                            "then compare embeddings of two different models")


@dataclass
class ExportOptions:
    format: Literal["colpali", "transformers", "sentence-transformers"] = option(
        None, "colpali: ColQwen2.from_pretrained (128-d projection only); transformers: "
              "ColQwen2ForRetrieval.from_pretrained (any dim); sentence-transformers: MultiVectorEncoder(DIR) with "
              "the prompts raggedvl trained with (any dim)", required=True)
    output: str = option(None, "a new (or empty) folder to write", required=True)
    merge_lora: bool = option(False, "colpali: fold LoRA into the weights and write a full checkpoint instead of an "
                                     "adapter (transformers and sentence-transformers always merge); a model "
                                     "without LoRA is refused")


@dataclass
class DataOptions:
    cache_dir: str | None = option(None, "where to build it (none: $RAGGEDVL_CACHE when set, else ~/.cache/raggedvl)")
    train_limit: int | None = option(None, "build at most this many training pairs", at_least=1)
    dev_limit: int | None = option(None, "build at most this many dev pairs", at_least=1)


def options_from(args: Any, cls: type) -> Any:
    """The ``cls`` options given on the command line (argparse namespace), checked against
    their declarations; ``ValueError`` naming the flag."""
    values = values_from(args, cls)
    check_given(cls, values)
    return cls(**values)


def command_arguments(opts: Any, *, drop: tuple[str, ...] = ("nproc_per_node",)) -> dict[str, Any]:
    """The options as keyword arguments of the command's function (launcher-only fields dropped)."""
    return {k: v for k, v in dataclasses.asdict(opts).items() if k not in drop}

"""``raggedvl`` command line: ``train``, ``eval``, ``encode``, ``mine``, ``search``, ``export``, ``data``.

``main(argv)`` is the whole CLI (it returns the exit code), so tests call it in-process;
``run()`` is the command's entry point (console script, ``python -m raggedvl.app.cli``): ``main``,
then exit without the interpreter's 2-3 s teardown of torch and transformers.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import NoReturn, Sequence

from raggedvl.app.command_options import (
    DataOptions,
    EncodeOptions,
    EvalOptions,
    ExportOptions,
    MineOptions,
    SearchOptions,
    command_arguments,
    options_from,
)
from raggedvl.app.gpu_driver import skip_triton
from raggedvl.app.launch import plain_output
from raggedvl.app.options import add_arguments
from raggedvl.app.rundir import check_new_folder, check_output_file, check_writable, results_folder
from raggedvl.data.columns import Columns


def _train(args, argv: Sequence[str]) -> int:
    from raggedvl.app.launch import launch_train

    return launch_train(args, argv)


def _start_ranks(args, argv: Sequence[str], command: str) -> None:
    """With ``--nproc-per-node`` N > 1 from a plain shell, replace this process with torchrun's
    agent running ``command`` on N ranks (never returns); else return and run here."""
    from raggedvl.app.launch import exec_agent, local_world_size, strip_torchrun_arguments, torchrun_command, under_torchrun

    nproc = getattr(args, "nproc_per_node", None)
    if nproc is None or under_torchrun() or local_world_size(nproc) == 1:
        return
    exec_agent(torchrun_command(args, strip_torchrun_arguments(argv), command=command))


def _check_inputs(args, *, model: str, what: str, columns: Columns | None = None) -> None:
    """Before torch is imported, in the launching process (ranks skip it: their launcher did it):
    what the checkpoint argument ``model`` and ``--dataset`` name (:func:`raggedvl.app.sources.resolve_source`:
    a mistyped path gets "did you mean", an offline or unreachable hub fails in seconds), and, given
    ``columns``, that a local parquet ``--dataset`` (not a BEIR folder) holds them. Raises ``ValueError``."""
    from raggedvl.app.sources import resolve_source
    from raggedvl.app.launch import under_torchrun

    if under_torchrun():
        return
    resolve_source(model, repo_type="model", presets=("tiny",), what=what, kind="folder")
    _check_not_an_empty_run(model, what)
    dataset = getattr(args, "dataset", None)
    if dataset is None:
        return
    resolve_source(dataset, repo_type="dataset", presets=("rdocs",), what="--dataset")
    if columns is not None:
        from raggedvl.app.column_flags import flags_for_columns
        from raggedvl.data.scan import check_columns
        from raggedvl.data.source import DataSource

        source = DataSource.of(dataset)
        table = source.parquet(args.split or source.default_split("test"))  # None for a BEIR layout, a hub id...
        if table is not None:
            with flags_for_columns(keys=False):
                check_columns(table.columns, table.where, columns)


def _check_not_an_empty_run(model: str, what: str) -> None:
    """Raise ``ValueError`` when ``model`` is a ``raggedvl train`` output folder that holds no
    checkpoint yet (it stopped before its first save) and no model files either."""
    from raggedvl.app.config import TRAIN_CONFIG_NAME
    from raggedvl.app.rundir import checkpoint_folders

    folder = Path(model).expanduser()
    is_run = (folder / TRAIN_CONFIG_NAME).is_file() and (folder / "metrics.jsonl").is_file()
    if not is_run or any(folder.glob("*.safetensors")) or (folder / "config.json").is_file() or \
            (folder / "adapter_config.json").is_file():  # a model folder, whatever else it holds
        return
    if not checkpoint_folders(folder / "checkpoints") + checkpoint_folders(folder / "best"):
        raise ValueError(f"{what} {model!r} is a training run with no checkpoint yet (it stopped before its first save); "
                         f"train it again with raggedvl train --output-dir {model} and its settings (without --resume: "
                         f"there is nothing to resume), or pass a checkpoint")


def _run_columns(opts, checkpoint: str, *, evaluation: bool) -> None:
    """With ``--dataset`` and a raggedvl run as ``checkpoint``: each column flag not given
    (``--query-column``, ``--image-column``, ``--id-column``) takes the run's column, its
    evaluation columns for ``evaluation`` (``raggedvl eval``), else its training columns
    (:func:`raggedvl.app.config.run_config`; flags given keep their values)."""
    from raggedvl.app.config import run_config

    cfg = run_config(checkpoint) if opts.dataset is not None else None
    if cfg is None:
        return
    columns = cfg.eval_columns if evaluation else cfg.columns
    for name, value in (("query_column", columns.query), ("image_column", columns.image), ("id_column", columns.id)):
        if getattr(opts, name) is None:
            setattr(opts, name, value)


def _eval(args, argv: Sequence[str]) -> int:
    opts = options_from(args, EvalOptions)
    opts.check_mteb()
    _run_columns(opts, args.checkpoint, evaluation=True)
    _check_inputs(opts, model=args.checkpoint, what="checkpoint", columns=opts.columns())
    if opts.output is None:
        check_writable(results_folder(args.checkpoint), "--output FILE", default=True)
    if opts.mteb:
        from raggedvl.app.mteb_eval import evaluate_with_mteb

        evaluate_with_mteb(args.checkpoint, opts.mteb, batch_size=opts.batch_size, output=opts.output)
        return 0
    if opts.output is not None:
        check_output_file(Path(opts.output))
    _start_ranks(args, argv, "eval")
    from raggedvl.app.evaluate_checkpoint import evaluate_checkpoint

    evaluate_checkpoint(args.checkpoint, **command_arguments(opts, drop=("nproc_per_node", "mteb")))
    return 0


def _encode(args, argv: Sequence[str]) -> int:
    opts = options_from(args, EncodeOptions)
    _check_inputs(opts, model=args.checkpoint, what="checkpoint", columns=opts.columns())
    check_writable(Path(opts.output), "--output")
    check_new_folder(opts.output, "encode")
    _start_ranks(args, argv, "encode")
    from raggedvl.app.index_commands import encode_corpus

    kwargs = command_arguments(opts, drop=("nproc_per_node", "image_column", "id_column"))
    encode_corpus(args.checkpoint, columns=opts.columns(), **kwargs)
    return 0


def _mine(args, argv: Sequence[str]) -> int:
    opts = options_from(args, MineOptions)
    if opts.max_positive_ratio > 1:
        raise ValueError(f"--max-positive-ratio must be in (0, 1], got {opts.max_positive_ratio}")
    _run_columns(opts, args.checkpoint, evaluation=False)
    _check_inputs(opts, model=args.checkpoint, what="checkpoint", columns=opts.columns())
    check_writable(Path(opts.output), "--output")
    check_new_folder(opts.output, "mine")
    _start_ranks(args, argv, "mine")
    from raggedvl.app.mine import mine

    kwargs = command_arguments(opts, drop=("nproc_per_node", "query_column", "image_column", "id_column"))
    mine(args.checkpoint, columns=opts.columns(), **kwargs)
    return 0


def _search(args) -> int:
    opts = options_from(args, SearchOptions)
    _check_inputs(opts, model=args.checkpoint, what="checkpoint")
    _check_search_arguments(opts)
    from raggedvl.app.index_commands import print_results, search_index

    results = search_index(args.checkpoint, index=opts.index, queries=opts.query, k=opts.k, chunk_size=opts.chunk_size,
                           allow_other_model=opts.allow_other_model)
    print_results(opts.query, results)
    return 0


def _check_search_arguments(opts: SearchOptions) -> None:
    """Before torch: no empty ``--query``, and an ``--index`` folder that exists (else "did you
    mean" a neighbour) and holds ``index.json``. Raises ``ValueError``."""
    from pathlib import Path

    from raggedvl.app.sources import missing_path

    for i, query in enumerate(opts.query):
        if not query.strip():
            raise ValueError(f"--query number {i + 1} is empty ({query!r}); give the text to search for")
    index = Path(opts.index).expanduser()
    if not index.exists():
        raise missing_path(opts.index, (), "--index", "folder")
    if not (index / "index.json").is_file():
        raise ValueError(f"--index {opts.index!r} is not an embedding index (no index.json); build one with raggedvl encode")


def _export(args) -> int:
    opts = options_from(args, ExportOptions)
    _check_inputs(opts, model=args.source, what="source")
    check_writable(Path(opts.output), "--output")
    check_new_folder(opts.output, "export")
    from raggedvl.app.export import export

    export(args.source, opts.format, opts.output, merge_lora=opts.merge_lora)
    return 0


def _data(args) -> int:
    from raggedvl.data import build_rdocs

    path = build_rdocs(**command_arguments(options_from(args, DataOptions)))
    print(path)
    return 0


DESCRIPTION = """\
Train and evaluate visual document retrievers (ColQwen-style late interaction or a bi-encoder)
on Qwen2-VL-family models, on one process or many (torchrun: DDP / FSDP2), with exact
cross-rank negatives and cost-balanced batches of dynamic-resolution images.
"""

EPILOG = """\
examples:
  raggedvl train                                   the built-in job: tiny model on the embedded rdocs pairs
                                                   (one process per GPU, or 2 processes on a CPU-only machine)
  raggedvl train --config my.yaml --lr 1e-4        YAML keys, overridden by flags
  raggedvl train --model vidore/colqwen2-v1.0 --dataset my_pairs.parquet --query-column question
                                                   continue training a colpali checkpoint on your (query, image) pairs
  raggedvl train --output-dir runs/a --resume      continue a run from its newest valid checkpoint
  raggedvl eval runs/a                             nDCG, Recall, MRR, MAP of the newest checkpoint on the run's dev split
  raggedvl eval runs/a --dataset benchmark/        another benchmark (BEIR folder, parquet pairs, hub id); writes a JSON
  raggedvl eval runs/a --mteb "ViDoRe(v3)"        mteb's own evaluator on an mteb benchmark or task: its main scores
  raggedvl encode runs/a --dataset corpus/ --output index/   embed a document collection
  raggedvl search runs/a --index index/ --query "quarterly revenue" -k 5   its top 5 documents for a query
  raggedvl mine runs/a --dataset pairs.parquet --output mined/ -k 4   hard negatives for a training set
  raggedvl export runs/a --format colpali --output out/colpali   load with colpali-engine (or --format transformers,
                                                   --format sentence-transformers)
  raggedvl data rdocs                              build the embedded dataset once and print its path

Every command has its own help: raggedvl train --help lists each config key with its units and choices.
"""


class _Parser(argparse.ArgumentParser):
    """argparse that reports errors in one line and suggests the closest flag for an unknown one
    (and the closest choice for an invalid value),
    and takes no abbreviations (``--max-train`` is not ``--max-train-samples``: a shortened flag
    would silently change meaning when a longer flag is added). Subparsers are of this class too."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def _check_value(self, action, value):  # type: ignore[override]
        """argparse's "invalid choice" with the choice a mistyped value most likely meant."""
        try:
            super()._check_value(action, value)
        except argparse.ArgumentError as exc:
            from raggedvl.app.options import choice_hint

            hint = choice_hint(value, action.choices or ())
            if not hint:
                raise
            raise argparse.ArgumentError(action, exc.message + hint) from None

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        namespace, extras = self.parse_known_args(args, namespace)
        if extras:
            parser = self
            for action in self._actions:
                if isinstance(action, argparse._SubParsersAction):
                    parser = action.choices.get(getattr(namespace, action.dest, None), self)
            from raggedvl.app.options import did_you_mean

            flags = [flag for flag in parser._option_string_actions if flag.startswith("--")]
            unknown = next((tok.split("=", 1)[0] for tok in extras if tok.startswith("--")), None)
            hint = did_you_mean(unknown, flags) if unknown else ""
            parser.error(f"unrecognized arguments: {' '.join(extras)}{hint}")
        return namespace


def build_parser() -> argparse.ArgumentParser:
    from raggedvl import __version__
    from raggedvl.app.config import add_config_arguments
    from raggedvl.app.launch import add_torchrun_arguments

    parser = _Parser(prog="raggedvl", description=DESCRIPTION, epilog=EPILOG,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"raggedvl {__version__} ({_stack_versions()})")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{train,eval,encode,mine,search,export,data}")

    p_train = sub.add_parser(
        "train",
        help="train a retriever (starts torchrun itself; the default job needs no arguments)",
        description="Train a retriever. Every config key is a flag; precedence: defaults < --config YAML < flags. "
                    "Started from a shell, raggedvl starts torchrun with the torchrun options below.",
    )
    p_train.add_argument("--config", default=None, metavar="YAML",
                         help="YAML file of config keys (the flag names with _ for -); flags override it")
    add_config_arguments(p_train)
    add_torchrun_arguments(p_train)

    checkpoint_help = ("a checkpoint folder (run/checkpoints/step-N), a run directory (its newest checkpoint that verifies) "
                       "or a model directory build_retriever loads")
    p_eval = sub.add_parser("eval", help="nDCG@1/3/5/10, Recall@1/5/10, MRR@10, MAP@10 of a checkpoint on a benchmark",
                            description="Score a checkpoint on a benchmark as ViDoRe / BEIR report it (trec_eval's "
                                        "definitions and tie order); prints a table and writes a results JSON.")
    p_eval.add_argument("checkpoint", help=checkpoint_help)
    add_arguments(p_eval, EvalOptions)

    p_encode = sub.add_parser("encode", help="embed a corpus's document images into an index folder (safetensors shards + ids)")
    p_encode.add_argument("checkpoint", help=checkpoint_help)
    add_arguments(p_encode, EncodeOptions)

    p_mine = sub.add_parser("mine", help="mine hard negatives for a training set with a retriever (positive-aware)",
                            description="Rank the training set's pages for each of its queries with a checkpoint, drop "
                                        "the query's positives, their duplicates and likely unlabelled positives, and "
                                        "write the training set with k hard negatives per query.")
    p_mine.add_argument("checkpoint", help=checkpoint_help)
    add_arguments(p_mine, MineOptions)

    p_search = sub.add_parser("search", help="top-k documents of a query in an index (exact, chunked MaxSim / cosine)")
    p_search.add_argument("checkpoint", help=checkpoint_help + " (the one that built the index)")
    add_arguments(p_search, SearchOptions)

    p_export = sub.add_parser(
        "export", help="write a trained retriever for colpali-engine, transformers or sentence-transformers, with a "
                       "model card",
        description="Write a retriever in the layout colpali-engine (ColQwen2), transformers (ColQwen2ForRetrieval) or "
                    "sentence-transformers (MultiVectorEncoder) loads, with its processor and a model card (README.md).")
    p_export.add_argument("source", help="a run directory (newest checkpoint), a checkpoint folder, or any checkpoint "
                                         "raggedvl loads (a saved retriever, a colpali, transformers or "
                                         "sentence-transformers checkpoint)")
    add_arguments(p_export, ExportOptions)

    p_data = sub.add_parser("data", help="build an embedded dataset and print its path",
                            description="Build an embedded dataset (or reuse its earlier build) in a folder of the "
                                        "data cache, --cache-dir, else $RAGGEDVL_CACHE when set, else "
                                        "~/.cache/raggedvl, and print the folder's path.")
    p_data.add_argument("name", choices=["rdocs"], help="dataset name")
    add_arguments(p_data, DataOptions)
    return parser


def _stack_versions() -> str:
    from importlib import metadata

    found = []
    for name in ("torch", "transformers", "accelerate", "peft"):
        try:
            found.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            found.append(f"{name} missing")
    return ", ".join(found)


def _is_input_error(exc: BaseException) -> bool:
    """Bad input (exit code 2, one line): a ``ValueError`` or a ``CheckpointError``."""
    checkpoint = sys.modules.get("raggedvl.app.checkpoint")  # not imported: not its error
    return isinstance(exc, ValueError) or (checkpoint is not None and isinstance(exc, checkpoint.CheckpointError))


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns the exit code. Bad input is one line on stderr and exit code 2;
    Ctrl-C is exit code 130 with one line (``raggedvl train``: the step and the checkpoint to
    resume from, ``raggedvl.app.interrupts``) and no traceback.
    In a rank started by torchrun, a failure is also written to torchrun's error file, and in a
    rank of ``raggedvl.app.agent`` that record is all it leaves (the agent prints the first
    failing rank's line once)."""
    skip_triton()  # before torch's compiler is imported: a machine without a GPU never uses Triton
    plain_output()  # outside a terminal: no carriage-return bars from datasets, the hub or transformers' loading
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    commands = {"train": lambda: _train(args, argv[1:]), "eval": lambda: _eval(args, argv[1:]),
                "encode": lambda: _encode(args, argv[1:]), "mine": lambda: _mine(args, argv[1:]),
                "search": lambda: _search(args), "export": lambda: _export(args),
                "data": lambda: _data(args)}
    try:
        try:
            return commands[args.command]()
        except Exception as exc:
            return _failed(exc)
    except KeyboardInterrupt as exc:  # Ctrl-C: exit code 130, no traceback (also one raised while failing)
        return _interrupted(exc)


def _failed(exc: Exception) -> int:
    """The exit code of a command that raised ``exc`` (module docstring of ``main``), or re-raise."""
    code = 2 if _is_input_error(exc) else 1
    from raggedvl.app.launch import under_torchrun

    if under_torchrun():
        from raggedvl.app.agent import quiet_ranks, record_failure

        record_failure(exc, exit_code=code)
        if quiet_ranks():
            return code
        raise exc
    if code == 2:
        print(f"raggedvl: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    raise exc


def _interrupted(exc: BaseException) -> int:
    """Ctrl-C: ignore further SIGINTs (the process is exiting) and return 130. ``raggedvl train``'s
    loop has already printed its one line (``raggedvl.app.interrupts.TrainingInterrupted``,
    possibly as the context of a second Ctrl-C); elsewhere the launching process (or rank 0)
    prints ``raggedvl: interrupted``."""
    import os
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    interrupts = sys.modules.get("raggedvl.app.interrupts")  # not imported: not the loop's
    seen, reported = exc, False
    while seen is not None and not reported:
        reported = interrupts is not None and isinstance(seen, interrupts.TrainingInterrupted)
        seen = seen.__context__
    if not reported and os.environ.get("RANK", "0") == "0":
        try:
            print("raggedvl: interrupted", file=sys.stderr, flush=True)
        except (OSError, ValueError):
            pass
    return 128 + signal.SIGINT


def run() -> NoReturn:
    """The ``raggedvl`` command (console script and ``python -m raggedvl.app.cli``, the ranks' entry
    too): :func:`main`, then the process ends without the interpreter's teardown
    (``raggedvl.app.agent.exit_now``: atexit handlers run and stdout / stderr are flushed
    first; every file raggedvl writes is closed when it is written). An exception that escapes
    ``main`` (a bug, not bad input) takes Python's normal way out, traceback included.
    Output whose reader has gone (``raggedvl train | head``) is dropped and the command runs to
    its end (``raggedvl.app.closed_output``)."""
    from raggedvl.app.closed_output import drop_output_when_closed

    drop_output_when_closed()
    code = main()
    from raggedvl.app.agent import exit_now

    exit_now(code)


if __name__ == "__main__":
    run()

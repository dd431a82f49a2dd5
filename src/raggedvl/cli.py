"""``raggedvl`` command line: ``train``, ``eval``, ``data``.

``main(argv)`` is the whole CLI, so tests call it in-process.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence


def _train(args, argv: Sequence[str]) -> int:
    from raggedvl.train.config import config_from_args
    from raggedvl.train.launch import run_torchrun, strip_torchrun_arguments, torchrun_command, under_torchrun

    cfg = config_from_args(args)  # validate before starting any process
    from raggedvl.train.setup import check_output_dir

    check_output_dir(cfg)
    if under_torchrun():
        from raggedvl.train.loop import train

        train(cfg)
        return 0
    from raggedvl.train.setup import prepare_data

    cmd = torchrun_command(args, strip_torchrun_arguments(argv))
    check_world_fits(cfg, cmd)
    prepare_data(cfg)  # build / cache the dataset once, before the ranks start
    print("+ " + " ".join(cmd), flush=True)
    return run_torchrun(cmd)


def check_world_fits(cfg, cmd: list[str]) -> None:
    """Raise ``ValueError`` before starting torchrun when the processes cannot all get a sample."""
    def opt(name: str, default: int) -> int:
        if name not in cmd:
            return default
        value = cmd[cmd.index(name) + 1]
        try:
            number = int(value)
        except ValueError:
            raise ValueError(f"{name} must be an integer, got {value!r}") from None
        if number < 1:
            raise ValueError(f"{name} must be >= 1, got {number}")
        return number

    nnodes = cmd[cmd.index("--nnodes") + 1] if "--nnodes" in cmd else "1"
    world = opt("--nproc-per-node", 1) * (int(nnodes) if nnodes.isdigit() else 1)
    if cfg.global_batch_size < world:
        raise ValueError(
            f"global_batch_size {cfg.global_batch_size} < {world} processes: every rank needs at least one "
            f"sample per step; use --global-batch-size {world} or more"
        )


def _eval(args) -> int:
    from raggedvl.train.evaluate_checkpoint import evaluate_checkpoint

    evaluate_checkpoint(args.checkpoint, split=args.split, batch_size=args.batch_size, max_samples=args.max_samples)
    return 0


def _data(args) -> int:
    from raggedvl.data import build_rdocs

    path = build_rdocs(cache_dir=args.cache_dir, train_limit=args.train_limit, dev_limit=args.dev_limit)
    print(path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from raggedvl.train.config import add_config_arguments
    from raggedvl.train.launch import add_torchrun_arguments

    parser = argparse.ArgumentParser(prog="raggedvl", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p_train = sub.add_parser(
        "train",
        help="train a ColQwen-style retriever (starts torchrun itself; the default job needs no arguments)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p_train.add_argument("--config", default=None, help="YAML file of config keys; flags override it")
    add_config_arguments(p_train)
    add_torchrun_arguments(p_train)

    p_eval = sub.add_parser("eval", help="nDCG@5, Recall@1/5, MRR@10 of a checkpoint on a split")
    p_eval.add_argument("checkpoint", help="a checkpoint folder (run/checkpoints/step-N) or a run directory (newest checkpoint)")
    p_eval.add_argument("--split", default=None, help="default: the run's eval split")
    p_eval.add_argument("--batch-size", type=int, default=16)
    p_eval.add_argument("--max-samples", type=int, default=None)

    p_data = sub.add_parser("data", help="build an embedded dataset")
    p_data.add_argument("name", choices=["rdocs"])
    p_data.add_argument("--cache-dir", default=None)
    p_data.add_argument("--train-limit", type=int, default=None, help="build at most this many training pairs")
    p_data.add_argument("--dev-limit", type=int, default=None, help="build at most this many dev pairs")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    from raggedvl.train.checkpoint import CheckpointError

    try:
        if args.command == "train":
            return _train(args, argv[1:])
        if args.command == "eval":
            return _eval(args)
        return _data(args)
    except (ValueError, CheckpointError) as exc:
        if "LOCAL_RANK" in os.environ:  # inside torchrun: the rank's own report already named it
            raise
        print(f"raggedvl: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

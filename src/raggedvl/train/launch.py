"""Start ``raggedvl train`` under torchrun, or run it directly when already under torchrun.

``raggedvl train`` on a plain shell starts ``python -m torch.distributed.run`` itself with the
torchrun options it was given (``--nproc-per-node`` defaults to the number of CUDA devices,
or 2 processes on a CPU-only machine; ``--standalone`` unless ``--nnodes``/``--rdzv-*`` say
otherwise), after preparing the data once in the launching process. Inside torchrun
(``TORCHELASTIC_RUN_ID`` or ``LOCAL_RANK`` set) it runs the training loop directly.
Multi-node jobs use torchrun's own rendezvous: run the same command on every node with
``--nnodes N --node-rank I --rdzv-endpoint HOST:PORT`` (or ``--master-addr``/``--master-port``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Sequence

TORCHRUN_OPTIONS = (
    "nproc_per_node", "nnodes", "node_rank", "rdzv_backend", "rdzv_endpoint", "rdzv_id",
    "master_addr", "master_port", "max_restarts",
)


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


def add_torchrun_arguments(parser) -> None:
    group = parser.add_argument_group("torchrun (passed through when raggedvl starts torchrun itself)")
    for name in TORCHRUN_OPTIONS:
        group.add_argument("--" + name.replace("_", "-"), dest=name, default=None)


def default_nproc() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def torchrun_command(args, train_argv: Sequence[str]) -> list[str]:
    """The ``python -m torch.distributed.run ... -m raggedvl.cli train ...`` command line."""
    opts = {name: getattr(args, name) for name in TORCHRUN_OPTIONS if getattr(args, name, None) is not None}
    opts.setdefault("nproc_per_node", str(default_nproc()))
    multi_node = any(k in opts for k in ("nnodes", "rdzv_endpoint", "master_addr"))
    cmd = [sys.executable, "-m", "torch.distributed.run"]
    if not multi_node:
        cmd.append("--standalone")
    for name, value in opts.items():
        cmd += ["--" + name.replace("_", "-"), str(value)]
    return cmd + ["-m", "raggedvl.cli", "train", *train_argv]


def strip_torchrun_arguments(argv: Sequence[str]) -> list[str]:
    """``argv`` without the torchrun options (``--opt value`` and ``--opt=value`` forms)."""
    flags = {"--" + n.replace("_", "-") for n in TORCHRUN_OPTIONS}
    out: list[str] = []
    skip = False
    for tok in argv:
        if skip:
            skip = False
            continue
        if tok in flags:
            skip = True
            continue
        if tok.split("=", 1)[0] in flags:
            continue
        out.append(tok)
    return out


def run_torchrun(cmd: list[str]) -> int:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.call(cmd, env=env)

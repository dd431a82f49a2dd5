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

TORCHRUN_HELP = {  # name: (metavar, help)
    "nproc_per_node": ("N", "processes on this node: a number, or gpu (one per CUDA device), auto (one per accelerator, "
                      "else one per CPU core) or cpu (one per CPU core), as torchrun reads them "
                      "(default: the number of CUDA devices, or 2 on a CPU-only machine)"),
    "nnodes": ("N", "number of nodes, or MIN:MAX for an elastic job (default: 1)"),
    "node_rank": ("RANK", "this node's rank, 0 to nnodes-1 (static rendezvous)"),
    "rdzv_backend": ("BACKEND", "torchrun rendezvous backend, e.g. c10d"),
    "rdzv_endpoint": ("HOST:PORT", "rendezvous address HOST:PORT, the same on every node"),
    "rdzv_id": ("ID", "job id shared by the nodes of one job"),
    "master_addr": ("HOST", "address of the rank-0 node (static rendezvous)"),
    "master_port": ("PORT", "port on the rank-0 node (static rendezvous)"),
    "max_restarts": ("N", "times torchrun restarts the workers after a failure (default: 0)"),
}
TORCHRUN_OPTIONS = tuple(TORCHRUN_HELP)


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


def add_torchrun_arguments(parser) -> None:
    group = parser.add_argument_group("torchrun (passed through when raggedvl starts torchrun itself)")
    for name in TORCHRUN_OPTIONS:
        metavar, text = TORCHRUN_HELP[name]
        group.add_argument("--" + name.replace("_", "-"), dest=name, default=None, metavar=metavar, help=text)


def default_nproc() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def local_world_size(nproc_per_node: str) -> int:
    """Processes torchrun starts for ``--nproc-per-node`` (a number, ``gpu``, ``auto``, ``cpu``;
    torchrun's ``determine_local_world_size`` rules). Raises ``ValueError`` for anything else,
    for a number < 1, and for ``gpu`` without a CUDA device."""
    import torch

    if nproc_per_node.lstrip("-").isdigit():
        number = int(nproc_per_node)
        if number < 1:
            raise ValueError(f"--nproc-per-node must be >= 1, got {number}")
        return number
    if nproc_per_node == "gpu":
        if not torch.cuda.is_available():
            raise ValueError("--nproc-per-node gpu: no CUDA device is visible; give a number of processes or auto")
        return torch.cuda.device_count()
    if nproc_per_node == "auto" and torch.accelerator.is_available():
        return torch.accelerator.device_count()
    if nproc_per_node in ("auto", "cpu"):
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    raise ValueError(f"--nproc-per-node must be a number, gpu, auto or cpu, got {nproc_per_node!r}")


def torchrun_command(args, train_argv: Sequence[str], command: str = "train") -> list[str]:
    """The ``python -m torch.distributed.run ... -m raggedvl.cli COMMAND ...`` command line."""
    opts = {name: getattr(args, name) for name in TORCHRUN_OPTIONS if getattr(args, name, None) is not None}
    opts.setdefault("nproc_per_node", str(default_nproc()))
    multi_node = any(k in opts for k in ("nnodes", "rdzv_endpoint", "master_addr"))
    cmd = [sys.executable, "-m", "torch.distributed.run"]
    if not multi_node:
        cmd.append("--standalone")
    for name, value in opts.items():
        cmd += ["--" + name.replace("_", "-"), str(value)]
    return cmd + ["-m", "raggedvl.cli", command, *train_argv]


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

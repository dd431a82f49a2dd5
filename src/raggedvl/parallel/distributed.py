"""The torch.distributed transport of raggedvl, in one import (the shared contract's module).

Process-group lifecycle lives in :mod:`raggedvl.parallel.runtime`, the ragged autograd-aware
gathers in :mod:`raggedvl.parallel.gather` and the cross-rank shape agreement check in
:mod:`raggedvl.parallel.agreement`; this module re-exports their public names so callers write
``from raggedvl.parallel.distributed import all_gather_variable, get_rank``.
"""

from raggedvl.parallel.agreement import DEBUG_ENV, exchange_shapes
from raggedvl.parallel.gather import PaddedGather, VariableGather, all_gather_padded, all_gather_variable
from raggedvl.parallel.runtime import (
    DEFAULT_TIMEOUT_S,
    DistInfo,
    get_rank,
    get_world_size,
    init_distributed,
    is_distributed,
    shutdown,
)

__all__ = [
    "DEBUG_ENV",
    "DEFAULT_TIMEOUT_S",
    "DistInfo",
    "PaddedGather",
    "VariableGather",
    "all_gather_padded",
    "all_gather_variable",
    "exchange_shapes",
    "get_rank",
    "get_world_size",
    "init_distributed",
    "is_distributed",
    "shutdown",
]

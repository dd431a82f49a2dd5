"""raggedvl.parallel: the only package that imports torch.distributed.

Process-group setup (``init_distributed``, ``get_rank``, ``get_world_size``), autograd-aware
ragged all-gathers for cross-rank losses, and the single-process DataParallel / accelerate
transports of ragged batches.
"""

from raggedvl.parallel.distributed import (
    DEFAULT_TIMEOUT_S,
    DistInfo,
    PaddedGather,
    VariableGather,
    all_gather_padded,
    all_gather_variable,
    get_rank,
    get_world_size,
    init_distributed,
    is_distributed,
    shutdown,
)
from raggedvl.parallel.dataparallel import RaggedDataParallel, ScatteredBatch, gather_outputs, scatter_batch
from raggedvl.parallel.dispatch import RaggedDispatchSlicer, prepare_ragged_data_loader

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "DistInfo",
    "PaddedGather",
    "RaggedDataParallel",
    "RaggedDispatchSlicer",
    "ScatteredBatch",
    "VariableGather",
    "all_gather_padded",
    "all_gather_variable",
    "gather_outputs",
    "get_rank",
    "get_world_size",
    "init_distributed",
    "is_distributed",
    "prepare_ragged_data_loader",
    "scatter_batch",
    "shutdown",
]

"""raggedvl.parallel: the only package that imports torch.distributed.

Process-group setup (``init_distributed``, ``get_rank``, ``get_world_size``), autograd-aware
ragged all-gathers for cross-rank losses, and the single-process DataParallel / accelerate
transports of ragged batches, and which samples of an accelerate batch are repeats
(``real_sample_count``).
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
from raggedvl.parallel.repeats import check_repeats_identifiable, real_sample_count, real_sample_mask

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
    "check_repeats_identifiable",
    "gather_outputs",
    "get_rank",
    "get_world_size",
    "init_distributed",
    "is_distributed",
    "prepare_ragged_data_loader",
    "real_sample_count",
    "real_sample_mask",
    "scatter_batch",
    "shutdown",
]

"""raggedvl.parallel: the only package that imports torch.distributed; its front module.

Callers outside the package import from here: process-group lifecycle (``init_distributed``,
``is_distributed``, ``get_rank``, ``get_world_size``, ``shutdown``), small collectives on Python
values (``barrier``, ``all_reduce_max``, ``all_reduce_mean``, ``all_gather_floats``, ``all_gather_objects``),
autograd-aware ragged all-gathers for cross-rank losses, the cross-rank shape check,
DDP / FSDP2 wrapping, full and sharded state dicts and their DCP files, the single-process DataParallel and accelerate
transports of ragged batches, and which samples of an accelerate batch are repeats
(``real_sample_count``), rank-failure reporting (``report_failure``, ``StallWatchdog``), and encoder
rebalancing of the vision tower (``VisionRebalancer``).
"""

from raggedvl.parallel.agreement import DEBUG_ENV, exchange_shapes
from raggedvl.parallel.collectives import all_gather_floats, all_gather_objects, all_reduce_max, all_reduce_mean, barrier
from raggedvl.parallel.dataparallel import RaggedDataParallel, ScatteredBatch, gather_outputs, scatter_batch
from raggedvl.parallel.dispatch import RaggedDispatchSlicer, install_ragged_dispatch, prepare_ragged_data_loader
from raggedvl.parallel.faults import StallWatchdog, report_failure
from raggedvl.parallel.gather import (
    PaddedGather,
    VariableGather,
    all_gather_packed,
    all_gather_padded,
    all_gather_variable,
)
from raggedvl.parallel.repeats import check_repeats_identifiable, real_sample_count, real_sample_mask
from raggedvl.parallel.runtime import (
    DEFAULT_TIMEOUT_S,
    DistInfo,
    get_rank,
    get_world_size,
    init_distributed,
    is_distributed,
    set_collective_timeout,
    shutdown,
)
from raggedvl.parallel.sharded_state import (
    BackgroundWrite,
    check_metadata,
    checkpoint_group,
    read_full_state,
    read_sharded,
    write_sharded,
)
from raggedvl.parallel.wrap import (
    load_full_state_dicts,
    load_sharded_state_dicts,
    sharded_state_dicts,
    unwrap_model,
    wrap_model,
)
from raggedvl.parallel.vision_plan import VisionPlan, plan_vision_balance
from raggedvl.parallel.vision_rebalance import VisionRebalancer, all_to_all_rows

__all__ = [
    "BackgroundWrite",
    "DEBUG_ENV",
    "DEFAULT_TIMEOUT_S",
    "DistInfo",
    "PaddedGather",
    "RaggedDataParallel",
    "RaggedDispatchSlicer",
    "ScatteredBatch",
    "StallWatchdog",
    "VariableGather",
    "VisionPlan",
    "VisionRebalancer",
    "all_gather_floats",
    "all_gather_objects",
    "all_gather_packed",
    "all_gather_padded",
    "all_gather_variable",
    "all_to_all_rows",
    "all_reduce_max",
    "all_reduce_mean",
    "barrier",
    "check_metadata",
    "checkpoint_group",
    "check_repeats_identifiable",
    "exchange_shapes",
    "gather_outputs",
    "get_rank",
    "get_world_size",
    "init_distributed",
    "install_ragged_dispatch",
    "is_distributed",
    "load_full_state_dicts",
    "load_sharded_state_dicts",
    "plan_vision_balance",
    "prepare_ragged_data_loader",
    "real_sample_count",
    "read_full_state",
    "read_sharded",
    "real_sample_mask",
    "report_failure",
    "scatter_batch",
    "set_collective_timeout",
    "sharded_state_dicts",
    "shutdown",
    "unwrap_model",
    "wrap_model",
    "write_sharded",
]

"""raggedvl.sampling: cost-balanced distributed batch sampler, partitioner, size-based costs,
cost-model calibration, weighted mixing of datasets."""

from raggedvl.sampling.calibrate import CalibrationResult, calibrate, fit_cost_model, measure_times, relative_errors
from raggedvl.sampling.mixture import Mixture
from raggedvl.sampling.partition import PartitionInfeasible, partition_costs
from raggedvl.sampling.plan import epoch_permutation, global_batches, plan_epoch
from raggedvl.sampling.sampler import BalancedDistributedBatchSampler, SamplerPositionError
from raggedvl.sampling.sizes import SampleCosts, estimate_costs

__all__ = [
    "BalancedDistributedBatchSampler",
    "CalibrationResult",
    "Mixture",
    "PartitionInfeasible",
    "SampleCosts",
    "SamplerPositionError",
    "calibrate",
    "epoch_permutation",
    "estimate_costs",
    "fit_cost_model",
    "global_batches",
    "measure_times",
    "partition_costs",
    "plan_epoch",
    "relative_errors",
]

"""Which samples of an accelerate batch are real, and which repeat samples to complete the last batch.

Shape legend: W processes, b samples per process and batch, R real samples in the epoch's last
global batch (0 < R <= W*b).

When the number of samples is not a multiple of W*b, accelerate completes the epoch's last
global batch with samples from the start of the epoch, so that every process gets a batch:

- map-style dataset (``DataLoaderShard`` over ``BatchSamplerShard``, ``even_batches=True``, the
  default): 5 samples, W = 2, b = 2 give the last global batch ``[4, 0 | 1, 2]``;
- ``IterableDataset`` read by process 0 and dispatched (``DataLoaderDispatcher``, accelerate's
  default for an ``IterableDataset``): the last fetched samples plus the first W samples of the
  epoch, cut into equal per-process batches: ``[4 | 0]``;
- ``IterableDataset`` read by every process (``IterableDatasetShard``, ``dispatch_batches=False``):
  as for map-style.

In every case the global batch is the processes' batches in rank order and its first R
positions are the real samples, so process p's real samples are the first
``clamp(R - p * b_p, 0, n_p)`` of its batch (``n_p`` samples; ``b_p`` = its position stride: b
for a sharded loader, the equal per-process size of the last batch for a dispatcher). R comes
from the dispatcher's ``remainder`` (the samples it fetched for the last batch, what accelerate's
``gather_for_metrics`` keeps) or, for a sharded loader, from the sampler's or the dataset's
length (accelerate's own ``remainder`` is wrong for ``IterableDatasetShard``: it uses the padded
shard length). Nothing here communicates.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch


class _Tail(NamedTuple):
    real: int  # R: real samples of the last global batch (real batches when whole_batches)
    stride: int  # positions per process in the global batch
    whole_batches: bool = False  # variable-size batches: a process's batch is all real or all repeated


def _sampler_length(batch_sampler: Any) -> int | None:
    inner = getattr(batch_sampler, "sampler", None)
    for obj in (inner, getattr(batch_sampler, "dataset", None)):
        try:
            return len(obj)
        except TypeError:
            continue
    return None


def _shard_tail(dataloader: Any, world_size: int) -> _Tail | None:
    """The tail of a ``DataLoaderShard`` whose last global batch holds repeats, else None.

    Raises ``ValueError`` when repeats occur but R cannot be known (an ``IterableDataset``
    without ``__len__`` read by every process).
    """
    from accelerate.data_loader import BatchSamplerShard, IterableDatasetShard

    dataset = getattr(dataloader, "dataset", None)
    if isinstance(dataset, IterableDatasetShard):
        if dataset.drop_last:
            return None
        try:
            total = len(dataset.dataset)
        except TypeError:
            raise ValueError(
                f"{type(dataset.dataset).__name__} has no __len__ and every process reads it (accelerate "
                "dispatch_batches=False): its last batch is completed with repeated samples that cannot be told "
                "apart; keep dispatch_batches (accelerate's default for an IterableDataset), set drop_last "
                "(TrainingArguments.dataloader_drop_last=True), or give the dataset a __len__"
            ) from None
        per_process = dataset.batch_size // world_size if dataset.split_batches else dataset.batch_size
        stride = per_process * world_size
        return _Tail(total % stride, per_process) if total % stride else None
    shard = next((s for s in (getattr(dataloader, "batch_sampler", None), getattr(dataloader, "sampler", None))
                  if isinstance(s, BatchSamplerShard)), None)
    if shard is None or shard.drop_last or not shard.even_batches:
        return None  # no completion: every batch holds real samples only
    inner = shard.batch_sampler
    if shard.batch_size is None:  # variable-size batches: whole batches are cycled
        n_batches = len(inner)
        return _Tail(n_batches % world_size, 1, whole_batches=True) if n_batches % world_size else None
    total = _sampler_length(inner)
    if total is None:
        total = len(dataloader.dataset)
    per_process = shard.batch_size // world_size if shard.split_batches else shard.batch_size
    stride = per_process * world_size
    return _Tail(total % stride, per_process) if total % stride else None


def check_repeats_identifiable(dataloader: Any, world_size: int) -> None:
    """Raise ``ValueError`` now, before any batch or collective, when :func:`real_sample_count`
    could not tell the repeats of ``dataloader``'s last batch (see :func:`_shard_tail`)."""
    from accelerate.data_loader import DataLoaderShard

    if world_size > 1 and isinstance(dataloader, DataLoaderShard):
        _shard_tail(dataloader, world_size)


def real_sample_count(dataloader: Any, num_samples: int, *, rank: int, world_size: int) -> int:
    """How many of the ``num_samples`` samples of the batch ``dataloader`` just yielded on process
    ``rank`` (of ``world_size``) are real; the others, always the last ones of the batch, repeat
    samples to complete the epoch's last batch (module docstring).

    Call it right after the batch is yielded, before the next one is requested (the loader's
    ``end_of_dataloader`` / ``remainder`` describe its latest batch, as for accelerate's
    ``gather_for_metrics``). A loader that is not an accelerate ``DataLoaderShard`` /
    ``DataLoaderDispatcher``, a single process, and every batch but the last give
    ``num_samples``. With a variable-size batch sampler a process's last batch is all real or all
    repeated. No collective. Raises ``ValueError`` when the repeats cannot be told apart (an
    ``IterableDataset`` without ``__len__`` under ``dispatch_batches=False``).
    """
    from accelerate.data_loader import DataLoaderDispatcher, DataLoaderShard

    if world_size <= 1 or not getattr(dataloader, "end_of_dataloader", False):
        return num_samples
    if isinstance(dataloader, DataLoaderDispatcher):
        # remainder = samples fetched for the last global batch; every process got the same count
        real, stride = dataloader.remainder, num_samples
    elif isinstance(dataloader, DataLoaderShard):
        tail = _shard_tail(dataloader, world_size)
        if tail is None:
            return num_samples
        if tail.whole_batches:
            return num_samples if rank < tail.real else 0
        real, stride = tail.real, tail.stride
    else:
        return num_samples
    if real < 0:  # accelerate did not record the tail: nothing was completed
        return num_samples
    return max(0, min(num_samples, real - rank * stride))


def real_sample_mask(dataloader: Any, num_samples: int, *, rank: int, world_size: int,
                     device: Any = None) -> torch.Tensor:
    """Bool ``[num_samples]``, True for the real samples of the batch just yielded: the first
    :func:`real_sample_count` ones. Pass it as ``valid=`` to a raggedvl loss. No collective."""
    n_real = real_sample_count(dataloader, num_samples, rank=rank, world_size=world_size)
    return torch.arange(num_samples, device=device) < n_real

"""The training loop's batch stream: this rank's sampler steps, collated by worker processes.

:class:`StepIndices` is the ``DataLoader``'s batch sampler: the rank's index lists, epoch after
epoch (``sampler.set_epoch``), and for every list it hands out, the sampler position after it
(epoch, steps of that epoch consumed). The loader's ``workers`` processes run ``dataset[i]`` and
the collator (image decode and resize, processor, ragged-batch validation) for the next batches
while the model trains; batches come back in sampler order, so the trainer pops one position
per batch it trains on and checkpoints THAT position, not the sampler's live one (which runs up
to ``workers * 2`` batches ahead): resume stays exact. ``workers=0`` collates in the training
process, one batch at a time. :func:`default_workers` starts one worker where it has a core of
its own.

Batches are the same whatever ``workers`` is: the collator draws no random numbers, and the
loader gets its own seeded generator, so creating it takes nothing from the global torch RNG
(``DataLoader`` otherwise draws its worker base seed from it, which would shift dropout and
every later random draw of the run). With ``pin_memory`` (CUDA) every batch's tensors are
page-locked (``RaggedBatch.pin_memory``), so ``.to(device, non_blocking=True)`` overlaps.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from collections import deque
from typing import Any, Callable, Iterator

import torch
from torch.utils.data import DataLoader

from raggedvl.app.wording import counted


class StepIndices:
    """Batch sampler over ``sampler`` from ``epoch`` on, endless; ``positions`` holds
    ``(epoch, steps of it consumed)`` after each index list handed out and not yet claimed, and
    ``sources`` (in step with it) the name of that step's source under one-source batches (the
    sampler's ``step_source``; None otherwise). ``with_epoch``: hand out ``(index, epoch)``
    pairs (for :class:`raggedvl.data.positives.EpochPositives`)."""

    def __init__(self, sampler, epoch: int, *, with_epoch: bool = False) -> None:
        self.sampler = sampler
        self.epoch = epoch
        self.with_epoch = with_epoch
        self.positions: deque[tuple[int, int]] = deque()
        self.sources: deque[str | None] = deque()

    def __iter__(self) -> Iterator[list[int]]:
        epoch = self.epoch
        step_source = getattr(self.sampler, "step_source", lambda step: None)
        while True:
            self.sampler.set_epoch(epoch)
            for indices in self.sampler:
                done = self.sampler.state_dict()["step"]
                self.positions.append((epoch, done))
                self.sources.append(step_source(done - 1))
                yield [(i, epoch) for i in indices] if self.with_epoch else indices
            epoch += 1


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one, e.g. under
    ``taskset`` or a container's cpuset; else ``os.cpu_count()``)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def default_workers(*, cuda: bool, ranks_on_node: int, threads_per_rank: int, cores: int) -> int:
    """Data workers per rank when ``--data-workers`` is not given: 1 on CUDA (the GPU computes,
    a core collates the next batch); on CPU 1 where every rank on the node keeps its compute
    threads and a worker still gets a core of its own (``cores >= ranks_on_node *
    (threads_per_rank + 1)``), else 0, since a worker without a spare core only takes time from
    the ranks' compute threads. Raises ``ValueError`` for counts below 1."""
    if min(ranks_on_node, threads_per_rank, cores) < 1:
        raise ValueError(f"ranks_on_node, threads_per_rank and cores must be >= 1, got {ranks_on_node}, "
                         f"{threads_per_rank}, {cores}")
    if cuda:
        return 1
    return int(cores >= ranks_on_node * (threads_per_rank + 1))


def step_batches(dataset, collate: Callable[[list[dict[str, Any]]], dict[str, Any]], indices: StepIndices, *,
                 workers: int, pin_memory: bool) -> Iterator[dict[str, Any]]:
    """Endless iterator of collated batches in sampler order (module docstring); ``workers``
    processes (fork) collate ahead of the training thread, 0 collates in it (also, with a
    warning, in a daemonic process, which may not start children). Errors raised by
    the collator reach the caller (from a worker: re-raised by the ``DataLoader``, same type,
    the worker's traceback in the message)."""
    if workers < 0:
        raise ValueError(f"workers must be >= 0, got {workers}")
    if workers and multiprocessing.current_process().daemon:  # e.g. a multiprocessing.Pool worker
        print(f"raggedvl: this process is daemonic and cannot start {counted(workers, 'data worker')}; collating in the "
              "training process (--data-workers 0)", file=sys.stderr, flush=True)
        workers = 0
    loader = DataLoader(dataset, batch_sampler=indices, collate_fn=collate, num_workers=workers,
                        pin_memory=pin_memory, prefetch_factor=2 if workers else None,
                        generator=torch.Generator().manual_seed(0))
    return iter(loader)

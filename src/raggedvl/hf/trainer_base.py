"""The shared base of raggedvl's HF Trainers: ragged Qwen-VL batches in every launch mode.

:class:`raggedvl.hf.RaggedTrainer` (retrieval) and :class:`raggedvl.hf.RaggedSFTTrainer` (SFT)
add their losses on top of :class:`RaggedTrainerBase`.

Shape legend: B samples on this process, N = sum of B over processes, W processes, L tokens,
D embedding dim.

Three launch modes, one script:

- ``python train.py`` on several GPUs: the Trainer would wrap the model in ``nn.DataParallel``
  (even chunking cuts patches away from grids, case C01); here it is
  :class:`raggedvl.parallel.RaggedDataParallel` (whole samples per replica, cost-balanced).
- accelerate ``dispatch_batches`` (the default for an ``IterableDataset``): batches travel in
  wire form (:mod:`raggedvl.batch.wire`) and are sliced by whole samples
  (:mod:`raggedvl.parallel.dispatch`, case C03).
- ``torchrun`` / ``accelerate launch``: accelerate's DDP; each process collates its own batch.

Batches arrive as wire-form tensor dicts (:mod:`raggedvl.hf.collator`) and are rebuilt into
validated :class:`~raggedvl.batch.RaggedBatch` es before counting label tokens and before the
forward pass; ``remove_unused_columns`` is ignored (the collators pick their own fields).

Repeated samples: when the dataset size is not a multiple of W x per-device batch, accelerate
completes the epoch's last batch with samples from the start of the epoch (``even_batches``;
an ``IterableDataset``'s dispatcher likewise). Each batch is marked as it leaves the
dataloader (:func:`raggedvl.parallel.real_sample_mask`, before the Trainer counts label tokens):
each trainer marks the repeats its own way (:meth:`RaggedTrainerBase.mark_repeats`). The
logged loss and every gradient are those of the real global batch, with gradient
accumulation, GradCache steps and ``dataloader_drop_last=False`` alike. Evaluation returns,
on every process, the loss of each step's real global batch, which accelerate's
``gather_for_metrics`` weights by the step's real samples (for an ``IterableDataset`` read by
every process, ``dispatch_batches=False``, accelerate miscounts them and the last step weighs
a full batch; its loss is still real). A configuration whose repeats cannot be told apart (an
``IterableDataset`` without ``__len__`` under ``dispatch_batches=False``) raises
``ValueError`` before training.

Failures (as in ``raggedvl train``, :mod:`raggedvl.parallel.faults`): every collective of the
process group is bounded by ``collective_timeout_s`` (default ``args.ddp_timeout``); during
``train()`` / ``evaluate()`` a watchdog names a process that spends more than half of it in one
step (``raggedvl: rank R has spent X s in step S ...``, with its stack, left as a note in the
group's store), and a process whose call fails prints ``raggedvl: rank R failed in step S: ...``
followed by its peers' notes, aborts the group so peers fail fast, and re-raises.

Collectives: accelerate's own (dispatch broadcast, DDP all-reduce, token-count gather) and
those of each trainer's loss.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Mapping

import torch
from torch import nn
from transformers import Trainer

from raggedvl.batch import RaggedBatch
from raggedvl.batch.wire import NUM_TOKENS, is_wire, unpack
from raggedvl.families import processor_batch_format
from raggedvl.parallel import (
    RaggedDataParallel,
    StallWatchdog,
    check_repeats_identifiable,
    install_ragged_dispatch,
    real_sample_mask,
    report_failure,
    set_collective_timeout,
)


def num_samples(data: Any) -> int | None:
    """Samples in a collated batch: a wire dict, a feature dict, a ragged batch, or a dict of them."""
    if is_wire(data):
        return int(data[NUM_TOKENS].shape[0])
    if isinstance(data, RaggedBatch):
        return data.num_samples
    if isinstance(data, Mapping) and "input_ids" in data:
        return int(data["input_ids"].shape[0])
    if isinstance(data, Mapping):
        return next((n for n in map(num_samples, data.values()) if n is not None), None)
    return None


class RaggedTrainerBase(Trainer):
    """``transformers.Trainer`` for Qwen2-VL-family ragged batches (module docstring); subclasses
    give the loss and :meth:`mark_repeats`.

    Args (besides the Trainer's own):
        processor: the model's processor (placeholder token ids, pad id, layout).
        collective_timeout_s: seconds after which any collective of the process group fails
            (default ``args.ddp_timeout``, which accelerate applied when it created the group);
            given, it is applied to the existing default group.

    Raises ``ValueError`` for a non-positive timeout.
    """

    def __init__(self, model: nn.Module | None = None, args: Any = None, *, processor: Any,
                 collective_timeout_s: float | None = None, **kwargs: Any) -> None:
        if "task" in kwargs:
            raise TypeError("task= is not an argument: RaggedTrainer trains retrievers, RaggedSFTTrainer "
                            "fine-tunes generative models")
        if collective_timeout_s is not None and not collective_timeout_s > 0:
            raise ValueError(f"collective_timeout_s must be > 0 seconds, got {collective_timeout_s}")
        if args is not None and getattr(args, "ddp_find_unused_parameters", False) is None:
            # every parameter takes part in every forward (the dummy vision pass runs the tower on
            # processes without images): DDP's search for unused ones is an autograd walk per step
            args.ddp_find_unused_parameters = False
        super().__init__(model=model, args=args, **kwargs)
        self.processor = processor
        self.layout, self.token_ids = processor_batch_format(processor)
        self.pad_token_id = int(getattr(getattr(processor, "tokenizer", processor), "pad_token_id", 0) or 0)
        if collective_timeout_s is not None:
            set_collective_timeout(collective_timeout_s)
        self.collective_timeout_s = float(collective_timeout_s or self.args.ddp_timeout)
        self._watchdog: StallWatchdog | None = None

    # ------------------------------------------------------------------ failures
    @contextlib.contextmanager
    def _watched(self, phase: str) -> Iterator[None]:
        """Run a top-level call under the stall watchdog; report and abort if it raises (module
        docstring). Nested calls (evaluation inside ``train()``) only rename the phase."""
        rank, world = self.accelerator.process_index, self.accelerator.num_processes
        outer = self._watchdog is None
        if outer:
            self._watchdog = StallWatchdog(rank, self.collective_timeout_s, enabled=world > 1)
        previous = self._watchdog.phase
        self._watchdog.enter(phase)
        try:
            yield
        except Exception as exc:
            if outer and world > 1:
                report_failure(rank, self._watchdog.phase, exc)
            raise
        finally:
            if outer:
                self._watchdog.stop()
                self._watchdog = None
        if not outer:
            self._watchdog.enter(previous)

    def train(self, *args: Any, **kwargs: Any):
        with self._watched("before the first step"):
            return super().train(*args, **kwargs)

    def evaluate(self, *args: Any, **kwargs: Any):
        with self._watched(f"in evaluation after step {self.state.global_step}"):
            return super().evaluate(*args, **kwargs)

    # ------------------------------------------------------------------ batches
    def decode_batch(self, data: Any) -> Any:
        """Rebuild every wire-form dict and every plain feature dict (has ``input_ids``) in
        ``data`` (nested dicts / lists) as a validated :class:`RaggedBatch` on ``args.device``;
        other values pass through. Raises ``ValueError`` naming the broken invariant."""
        if isinstance(data, RaggedBatch):
            return data.to(self.args.device)
        if is_wire(data):
            return unpack(data, self.layout, token_ids=self.token_ids, pad_token_id=self.pad_token_id).to(self.args.device)
        if isinstance(data, Mapping) and "input_ids" in data:
            return RaggedBatch.from_features(data, self.layout, token_ids=self.token_ids).to(self.args.device)
        if isinstance(data, Mapping):
            return {k: self.decode_batch(v) for k, v in data.items()}
        if isinstance(data, (list, tuple)):
            return type(data)(self.decode_batch(v) for v in data)
        return data

    def _prepare_inputs(self, inputs: Any) -> Any:
        return self._prepare_input(self.decode_batch(inputs))

    def _prepare_input(self, data: Any) -> Any:
        if isinstance(data, RaggedBatch):
            return data.to(self.args.device)
        return super()._prepare_input(data)

    def mark_real_samples(self, data: Any) -> Any:
        """Mark the repeats of the batch the active dataloader just yielded (module docstring,
        :meth:`mark_repeats`). Must run before the next batch is requested. No collective."""
        n = num_samples(data)
        if n is None:
            return data
        valid = real_sample_mask(self.accelerator.gradient_state.active_dataloader, n,
                                 rank=self.accelerator.process_index, world_size=self.accelerator.num_processes)
        return self.mark_repeats(data, valid)

    def mark_repeats(self, data: Any, valid: torch.Tensor) -> Any:
        """``data`` with its repeats marked; ``valid`` [B] bool is False on them."""
        raise NotImplementedError

    def get_batch_samples(self, epoch_iterator, num_batches: int, device: torch.device):
        if self._watchdog is not None:
            self._watchdog.enter(f"in step {self.state.global_step + 1}")
        # Mark and decode each batch as it arrives, before the Trainer counts label tokens
        # (wire labels are flat per batch; the next batch changes the loader's end-of-data state).
        batches = (self.decode_batch(self.mark_real_samples(b)) for b in epoch_iterator)
        return super().get_batch_samples(batches, num_batches, device)

    def _get_collator_with_removed_columns(self, data_collator, description: str | None = None):
        return data_collator  # ragged collators choose their own fields; never drop columns

    def _remove_unused_columns(self, dataset, description: str | None = None):
        return dataset

    def get_train_dataloader(self):
        loader = install_ragged_dispatch(super().get_train_dataloader(), self.layout, self.token_ids)
        check_repeats_identifiable(loader, self.accelerator.num_processes)
        return loader

    def get_eval_dataloader(self, eval_dataset=None):
        loader = install_ragged_dispatch(super().get_eval_dataloader(eval_dataset), self.layout, self.token_ids)
        check_repeats_identifiable(loader, self.accelerator.num_processes)
        return loader

    # ------------------------------------------------------------------ model wrapping
    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader=None) -> nn.Module:
        quantized = getattr(model, "is_loaded_in_8bit", False) or getattr(model, "is_loaded_in_4bit", False)
        if self.args.n_gpu > 1 and not quantized and not isinstance(model, nn.DataParallel):
            model = RaggedDataParallel(model, layout=self.layout, token_ids=self.token_ids)
        return super()._wrap_model(model, training, dataloader)

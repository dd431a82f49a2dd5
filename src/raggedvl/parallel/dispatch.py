"""Whole-sample slicing for accelerate's ``dispatch_batches=True`` (DESIGN.md section 3.2, case C03).

With ``dispatch_batches=True`` (accelerate's default for an ``IterableDataset``), process 0 reads
``num_processes`` batches, concatenates every tensor along dim 0, broadcasts the result, and each
process keeps ``slice(rank * b, (rank + 1) * b)`` of *every* tensor, b = samples per process.
For a Qwen2-VL batch that cuts ``pixel_values`` (patch rows) and ``image_grid_thw`` (image rows)
by position: patches are separated from their grids and from their samples' placeholder tokens.

``RaggedDispatchSlicer`` is a drop-in ``slice_fn_for_dispatch``: it receives that full,
broadcast batch and the sample slice and keeps exactly the samples in the slice, with their
tokens, patches, grids and per-item tensors. Two batch forms are cut:

- the *wire form* (:mod:`raggedvl.batch.wire`, what ``raggedvl.hf``'s collators emit): cut by
  samples with :func:`raggedvl.batch.wire.slice_samples` (views, no validation). Wire form is
  what makes accelerate's concatenation work when batches are padded to different lengths or
  some batch has no image;
- a feature dict / ``BatchFeature`` (has ``input_ids``): rebuilt as a ``RaggedBatch``
  (ownership from the placeholder tokens, all invariants checked) and ``select``-ed. Concatenating
  whole Qwen batches along dim 0 keeps them consistent (samples, images and patch rows stay in
  the same order) as long as they share one padded length (pad to a fixed ``max_length``, else
  accelerate's ``concatenate`` raises).

Either may sit in dicts, lists and tuples together with per-sample tensors or per-sample lists
(e.g. string ids), which are sliced by position. Positional semantics are kept because
accelerate also calls ``slice_fn(batch, slice(0, W))`` to take the first W samples that
complete a short last batch. A ``RaggedBatch`` object itself cannot pass through accelerate's
dispatcher (its ``concatenate`` and ``find_batch_size`` accept tensors only). No collective is
issued here; accelerate's broadcast happens before the slice.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from raggedvl.batch import BatchLayout, RaggedBatch
from raggedvl.batch.wire import is_wire, slice_samples


class RaggedDispatchSlicer:
    """``slice_fn(batch, tensor_slice, process_index=None, num_processes=None)`` keeping whole
    samples of ragged Qwen-family batches (wire form or feature dicts, module docstring).

    ``tensor_slice``: the slice of *samples* accelerate computed for this process. Wire dicts
    are cut to the samples in the slice (clipped to the batch); feature dicts are returned as
    the same mapping type (dict or ``BatchFeature``) holding the selected samples' tensors;
    per-sample lists and tensors are sliced by position.

    Raises ``ValueError`` if the full batch breaks a ragged invariant (e.g. per-sample tensors
    concatenated along the wrong dim, wire item counts that do not match the grid rows) or the
    slice exceeds a feature dict's samples (accelerate measured the batch size on a non-sample
    tensor: put ``input_ids`` first).
    """

    def __init__(self, layout: str | BatchLayout = "qwen2_vl", token_ids: Any = None):
        self.layout = layout
        self.token_ids = token_ids

    def __call__(self, data: Any, tensor_slice: slice, process_index: int | None = None,
                 num_processes: int | None = None) -> Any:
        return self._slice(data, tensor_slice)

    def _select(self, batch: RaggedBatch, tensor_slice: slice) -> RaggedBatch:
        stop = tensor_slice.stop
        if stop is not None and stop > batch.num_samples:
            raise ValueError(
                f"accelerate asked for samples {tensor_slice.start}:{stop} of a batch of {batch.num_samples} "
                "samples; it measured the batch size on a non-sample tensor: put input_ids first in the batch dict"
            )
        return batch.select(list(range(batch.num_samples))[tensor_slice])

    def _slice(self, data: Any, tensor_slice: slice) -> Any:
        if is_wire(data):
            return slice_samples(data, tensor_slice.start or 0, tensor_slice.stop, self.layout)
        if isinstance(data, RaggedBatch):
            return self._select(data, tensor_slice)
        if isinstance(data, Mapping):
            if "input_ids" in data:
                batch = RaggedBatch.from_features(data, self.layout, token_ids=self.token_ids)
                return type(data)(self._select(batch, tensor_slice).to_dict())
            return type(data)({k: self._slice(v, tensor_slice) for k, v in data.items()})
        if isinstance(data, torch.Tensor):
            return data[tensor_slice]
        if isinstance(data, (list, tuple)):
            nested = all(isinstance(x, (torch.Tensor, Mapping, list, tuple, RaggedBatch)) for x in data)
            if data and (nested or any(is_wire(x) for x in data)):
                parts = [self._slice(x, tensor_slice) for x in data]
                return type(data)(*parts) if hasattr(data, "_fields") else type(data)(parts)
            return data[tensor_slice]  # per-sample metadata such as string ids
        return data


def prepare_ragged_data_loader(dataloader: Any, accelerator: Any = None, *, layout: str | BatchLayout = "qwen2_vl",
                               token_ids: Any = None, **kwargs: Any) -> Any:
    """Prepare ``dataloader`` for accelerate with whole-sample dispatch slicing.

    With ``accelerator`` given, calls ``accelerator.prepare_data_loader(dataloader,
    slice_fn_for_dispatch=RaggedDispatchSlicer(...))``; otherwise
    ``accelerate.data_loader.prepare_data_loader(dataloader, slice_fn_for_dispatch=..., **kwargs)``
    (pass ``dispatch_batches=True``, ``put_on_device=True`` etc. there).

    Repeated samples: unless ``drop_last``, accelerate completes the epoch's last global batch
    with samples from the start of the epoch. Right after each batch, take
    ``valid = real_sample_mask(loader, batch_size, rank=..., world_size=...)``
    (:mod:`raggedvl.parallel.repeats`; the real samples come first) and pass it as ``valid=`` to
    the raggedvl loss, which then drops the repeats on every rank (never a query or a negative;
    N counts the real samples). Raises ``ValueError`` here, before any batch, when the repeats
    could not be told apart (an ``IterableDataset`` without ``__len__`` under
    ``dispatch_batches=False``).
    """
    from raggedvl.parallel.repeats import check_repeats_identifiable

    slicer = RaggedDispatchSlicer(layout, token_ids)
    if accelerator is not None:
        prepared = accelerator.prepare_data_loader(dataloader, slice_fn_for_dispatch=slicer, **kwargs)
        world_size = accelerator.num_processes
    else:
        from accelerate import PartialState
        from accelerate.data_loader import prepare_data_loader

        prepared = prepare_data_loader(dataloader, slice_fn_for_dispatch=slicer, **kwargs)
        world_size = kwargs.get("num_processes") or PartialState().num_processes  # accelerate's own default
    check_repeats_identifiable(prepared, world_size)
    return prepared


def install_ragged_dispatch(dataloader: Any, layout: str | BatchLayout = "qwen2_vl", token_ids: Any = None) -> Any:
    """Make an already accelerate-prepared dataloader slice by whole samples; returns it.

    A ``DataLoaderDispatcher`` gets a :class:`RaggedDispatchSlicer` as its ``slice_fn``; other
    dataloaders (each process loads its own batches: ``DataLoaderShard``, plain ``DataLoader``)
    never slice and are returned unchanged. No collective.
    """
    from accelerate.data_loader import DataLoaderDispatcher

    if isinstance(dataloader, DataLoaderDispatcher):
        dataloader.slice_fn = RaggedDispatchSlicer(layout, token_ids)
    return dataloader

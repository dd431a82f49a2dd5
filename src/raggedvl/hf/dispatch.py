"""accelerate ``dispatch_batches``: slice wire-form batches by whole samples.

accelerate's ``DataLoaderDispatcher`` (used for an ``IterableDataset`` unless
``dispatch_batches=False``) fetches W batches on process 0, concatenates them, broadcasts the
result and calls ``slice_fn(batch, slice(p * b, (p + 1) * b), process_index=p,
num_processes=W)`` on every process. Its default ``slice_tensors`` cuts *every* tensor by that
row range, which hands process 0 all grid rows and half the patch rows (case C03). The slice
function here cuts each wire-form ragged batch (:mod:`raggedvl.hf.wire`) by *samples*: process p
gets samples ``p*b .. (p+1)*b - 1`` with exactly their tokens, grids and patch rows. Wire form
is what makes the concatenation work when batches are padded to different lengths or some
batch has no image; plain feature dicts padded to one length are handed to
:class:`raggedvl.parallel.RaggedDispatchSlicer`. Positional semantics are kept
because accelerate also calls ``slice_fn(batch, slice(0, W))`` to take the first W samples that
complete a short last batch. No collective is issued here (the broadcast is accelerate's).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from raggedvl.batch import BatchLayout
from raggedvl.parallel import RaggedDispatchSlicer

from .wire import is_wire, slice_samples


def ragged_slice_fn(layout: str | BatchLayout = "qwen2_vl", token_ids: Any = None) -> Callable[..., Any]:
    """A ``slice_fn_for_dispatch`` for ``accelerate.data_loader.prepare_data_loader``.

    Wire-form dicts (anywhere in nested dicts / lists) are cut by whole samples with
    :func:`raggedvl.hf.wire.slice_samples`; everything else goes to
    :class:`raggedvl.parallel.RaggedDispatchSlicer` (plain feature dicts padded to one length,
    per-sample tensors and lists).
    """
    slicer = RaggedDispatchSlicer(str(getattr(layout, "name", layout)), token_ids)

    def slice_fn(data: Any, tensor_slice: slice, process_index: int | None = None,
                 num_processes: int | None = None) -> Any:
        if is_wire(data):
            return slice_samples(data, tensor_slice.start or 0, tensor_slice.stop, layout)
        if isinstance(data, Mapping) and "input_ids" not in data:
            return type(data)({k: slice_fn(v, tensor_slice) for k, v in data.items()})
        if isinstance(data, (list, tuple)) and any(is_wire(x) for x in data):
            return type(data)(slice_fn(v, tensor_slice) for v in data)
        return slicer(data, tensor_slice)

    return slice_fn


def install_ragged_dispatch(dataloader: Any, layout: str | BatchLayout = "qwen2_vl", token_ids: Any = None) -> Any:
    """Make an accelerate-prepared dataloader slice by samples; returns it.

    A ``DataLoaderDispatcher`` gets :func:`ragged_slice_fn` as its ``slice_fn``; other
    dataloaders (each process loads its own batches: ``DataLoaderShard``, plain ``DataLoader``)
    never slice and are returned unchanged.
    """
    from accelerate.data_loader import DataLoaderDispatcher

    if isinstance(dataloader, DataLoaderDispatcher):
        dataloader.slice_fn = ragged_slice_fn(layout, token_ids)
    return dataloader

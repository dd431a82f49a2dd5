"""Sharded state dicts on disk with ``torch.distributed.checkpoint`` (DCP).

A DCP folder holds ``.metadata`` (written by the coordinating rank, rank 0: every key's global
shape, dtype and which chunk of which file holds each part) and one ``__R_0.distcp`` file per
rank R with the chunks that rank wrote. Under FSDP2 a rank writes its own shards of the
parameters and of the optimizer state; under DDP, where every rank holds the same tensors,
DCP's save planner gives each replicated tensor to one rank, so every tensor is written once.
Nothing is gathered: peak extra host memory of a save is what the writer stages of the rank's
own chunks.

Loading is resharding: each rank reads, from whichever files hold them, the parts of the
tensors its template state dict holds (its FSDP2 shards, or whole tensors under DDP and on one
process), so a checkpoint written by W processes loads on any other number.
:func:`read_full_state` reads a whole folder in one process without a process group (export,
evaluation, ``--model``).

DCP reads ``.metadata`` with ``pickle``; :func:`check_metadata` unpickles it first with only the
classes DCP's metadata is made of (and :func:`read_sharded` / :func:`read_full_state` do so
before every read), so a crafted metadata file that would run code is refused.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pickle
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from raggedvl.parallel.runtime import is_distributed


class ShardedWriteError(RuntimeError):
    """Some rank's part of a DCP save failed (raised on every rank)."""


_METADATA_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
_METADATA_CLASSES = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
                     ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath")}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        allowed = (module in _METADATA_MODULES or (module, name) in _METADATA_CLASSES
                   or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)))
        if not allowed:
            raise pickle.UnpicklingError(f"{module}.{name} is not part of torch.distributed.checkpoint's metadata")
        return super().find_class(module, name)


def check_metadata(folder: str | os.PathLike) -> None:
    """Unpickle ``folder/.metadata`` with only DCP's metadata classes (and ``torch.Size``, dtypes,
    layouts, paths); raises ``pickle.UnpicklingError`` naming the file and the class otherwise."""
    path = Path(folder) / ".metadata"
    with open(path, "rb") as f:
        try:
            _MetadataUnpickler(f).load()
        except pickle.UnpicklingError as exc:
            raise pickle.UnpicklingError(f"{path}: {exc}") from exc


@contextlib.contextmanager
def _quiet_single_process():
    """DCP warns on every call without a process group that it assumes one process: that is the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def checkpoint_group() -> dist.ProcessGroup | None:
    """A gloo process group of all ranks for background checkpoint writes (their collectives run
    in another thread and must not interleave with the training's on the default group); None
    without a process group. Collective: every rank calls it, in the same order."""
    return dist.new_group(backend="gloo") if is_distributed() else None


class BackgroundWrite:
    """DCP folders written in a background thread from a copy of the state taken now.

    ``writes``: (folder, state dict) pairs, written one after the other (a ``dcp.save`` each)
    over ``group`` (:func:`checkpoint_group`; None without a process group). The constructor
    copies every state dict to host memory (``DefaultStager``; pinned when ``pinned``, for
    faster copies from CUDA) before it returns, so the training may update the originals at once;
    the copy is this rank's shards only. :meth:`result` waits for the write."""

    def __init__(self, writes: list[tuple[Path, dict[str, Any]]], group: dist.ProcessGroup | None, *,
                 pinned: bool) -> None:
        options = StagingOptions(use_pinned_memory=pinned, use_shared_memory=False, use_async_staging=False,
                                 use_non_blocking_copy=False)
        staged = []
        for folder, state_dict in writes:  # one stager per state dict: each keeps its own copy
            stager = DefaultStager(options)
            staged.append((Path(folder), stager.stage(state_dict), stager))
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="raggedvl-checkpoint")
        self._future = self._executor.submit(self._write, staged, group)
        self._executor.shutdown(wait=False)

    @staticmethod
    def _write(staged, group) -> list[Path]:
        files: list[Path] = []
        try:
            for folder, state_dict, _ in staged:
                try:
                    with _quiet_single_process():
                        dcp.save(state_dict, checkpoint_id=str(folder), process_group=group)
                except CheckpointException as exc:
                    raise ShardedWriteError(f"{folder}: {exc}") from exc
                files += _own_files(folder, group)
        finally:
            for _, _, stager in staged:
                stager.close()
        return files

    def result(self) -> list[Path]:
        """The files this rank wrote, once the write finished (fsynced by DCP's writer). Raises
        :class:`ShardedWriteError` (every rank) when any rank's write failed, ``OSError`` for
        this rank's own failure outside DCP."""
        return self._future.result()


def _own_files(folder: Path, group: dist.ProcessGroup | None = None) -> list[Path]:
    rank = dist.get_rank(group) if is_distributed() else 0
    return sorted(Path(p) for p in glob.glob(str(folder / f"__{rank}_*.distcp")))


def write_sharded(folder: str | os.PathLike, state_dict: dict[str, Any]) -> list[Path]:
    """Write ``state_dict`` (this rank's part: plain tensors, DTensors, nested containers) into
    the DCP folder ``folder``; returns the files this rank wrote (fsynced by DCP's writer).

    Collective under a process group (every rank calls it with the same keys; DCP's planning
    gathers every rank's plan on rank 0 and scatters the deduplicated plan back). Raises
    :class:`ShardedWriteError` on every rank when any rank's write failed, naming each failed
    rank and its exception (DCP's ``CheckpointException``, a ``BaseException``, as its cause)."""
    folder = Path(folder)
    try:
        with _quiet_single_process():
            dcp.save(state_dict, checkpoint_id=str(folder))
    except CheckpointException as exc:
        raise ShardedWriteError(f"{folder}: {exc}") from exc
    return _own_files(folder)


def read_sharded(folder: str | os.PathLike, state_dict: dict[str, Any]) -> None:
    """Fill ``state_dict`` in place from the DCP folder ``folder``: each tensor (or this rank's
    DTensor shard) is read from the chunks that overlap it, whatever number of ranks wrote them.
    Collective under a process group. Raises DCP's ``CheckpointException`` when a key is
    missing or its global shape differs, ``pickle.UnpicklingError`` as :func:`check_metadata`."""
    check_metadata(folder)
    with _quiet_single_process():
        dcp.load(state_dict, checkpoint_id=str(folder))


def read_full_state(folder: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of the DCP folder ``folder``, whole, on the CPU, in this process only (no
    collective, no process group needed; a process group present is not used). The template is
    built from ``.metadata``: each key's global shape and dtype. Raises ``ValueError`` naming the
    folder when a key is not a tensor (this is for flat tensor state dicts, such as the model's),
    ``pickle.UnpicklingError`` as :func:`check_metadata`."""
    check_metadata(folder)
    metadata = dcp.FileSystemReader(str(folder)).read_metadata()
    template = {}
    for key, meta in metadata.state_dict_metadata.items():
        if not isinstance(meta, TensorStorageMetadata):
            raise ValueError(f"{folder}: {key!r} is not a tensor; read_full_state reads flat tensor state dicts")
        template[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
    with _quiet_single_process():
        dcp.load(template, checkpoint_id=str(folder), no_dist=True)
    return template

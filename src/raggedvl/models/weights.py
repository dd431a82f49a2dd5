"""Weight files: the tensors of a checkpoint folder read from safetensors headers and checked
before anything loads; atomic, umask-respecting writes.

A checkpoint folder holds ``model.safetensors`` or shards listed in ``model.safetensors.index.json``
(``adapter_model.safetensors`` for a peft adapter). :class:`TensorFiles` reads only the headers
(names, shapes, dtypes; a few KB) so a missing, misnamed or wrongly shaped tensor is reported
with the file and the tensor's name before a model is built or a weight is read. Nothing here
unpickles: a folder that has only ``*.bin`` / ``*.pt`` weights is refused.

Writing: :func:`save_tensors` writes a safetensors file atomically (temporary name, then rename)
with the permissions a plain ``open()`` would give (``0o666 & ~umask``), so checkpoints are
readable by the group like any other file the user writes (safetensors' own ``save_file``
creates its files with mode 0600).
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping

import torch
from safetensors import safe_open
from safetensors.torch import save_file

INDEX_SUFFIX = ".index.json"
PICKLE_WEIGHTS = ("pytorch_model.bin", "adapter_model.bin", "model.pt", "training_args.bin")


@dataclass(frozen=True)
class TensorInfo:
    """One stored tensor: the file holding it, its shape and safetensors dtype string."""

    file: Path
    shape: tuple[int, ...]
    dtype: str


class TensorFiles:
    """The tensors of ``<folder>/<name>`` (or its shards), by stored name.

    Raises ``ValueError`` naming the folder when neither ``name`` nor ``name + ".index.json"``
    exists (and, when only pickle weights are there, saying that they are not loaded).
    """

    def __init__(self, folder: str | os.PathLike, name: str = "model.safetensors") -> None:
        self.folder = Path(folder)
        single, index = self.folder / name, self.folder / (name + INDEX_SUFFIX)
        if single.is_file():
            files = [single]
            self.label = str(single)
        elif index.is_file():
            weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
            files = [self.folder / f for f in sorted(set(weight_map.values()))]
            self.label = str(index)
        else:
            pickles = [p for p in PICKLE_WEIGHTS if (self.folder / p).exists()]
            extra = f"; it has {pickles}, which raggedvl never unpickles (convert them to safetensors)" if pickles else ""
            raise ValueError(f"{self.folder} has no {name} (nor {name + INDEX_SUFFIX}){extra}")
        self.tensors: dict[str, TensorInfo] = {}
        for path in files:
            if not path.is_file():
                raise ValueError(f"{self.label} lists {path.name}, which is missing")
            try:
                with safe_open(str(path), framework="pt") as f:
                    for key in f.keys():
                        s = f.get_slice(key)
                        self.tensors[key] = TensorInfo(path, tuple(s.get_shape()), s.get_dtype())
            except Exception as exc:  # safetensors raises its own SafetensorError for a torn header
                raise ValueError(f"{path}: not a readable safetensors file ({exc})") from exc

    def __contains__(self, key: str) -> bool:
        return key in self.tensors

    def names(self) -> list[str]:
        return sorted(self.tensors)

    def first_present(self, *names: str) -> str | None:
        """The first of ``names`` stored here, or None."""
        return next((n for n in names if n in self.tensors), None)

    def load(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """The named tensors (CPU), read from their files."""
        by_file: dict[Path, list[str]] = {}
        for name in names:
            by_file.setdefault(self.tensors[name].file, []).append(name)
        out: dict[str, torch.Tensor] = {}
        for path, keys in by_file.items():
            with safe_open(str(path), framework="pt") as f:
                for key in keys:
                    out[key] = f.get_tensor(key)
        return out


def check_tensors(files: TensorFiles, expected: Mapping[str, tuple[int, ...]],
                  stored_name: Callable[[str], str], what: str) -> None:
    """Raise ``ValueError`` naming the file and the tensor when one of ``expected`` (model name ->
    shape) is absent from ``files`` or has another shape. ``stored_name`` maps a model name to
    the name it has in the file; ``what`` describes the model in the message."""
    missing = [stored_name(k) for k in expected if stored_name(k) not in files]
    if missing:
        raise ValueError(
            f"{files.label} lacks {len(missing)} tensor(s) of {what}, e.g. {missing[:3]}; "
            "the checkpoint is incomplete or of another architecture"
        )
    for key, shape in expected.items():
        info = files.tensors[stored_name(key)]
        if tuple(info.shape) != tuple(shape):
            raise ValueError(
                f"{info.file}: tensor {stored_name(key)!r} has shape {list(info.shape)}, but {what} needs "
                f"{list(shape)}; the checkpoint does not match its config"
            )


def meta_shapes(module: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every persistent tensor of ``module``'s state dict."""
    return {k: tuple(v.shape) for k, v in module.state_dict().items()}


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write(target: Path, write: Callable[[str], None]) -> None:
    """Write ``target`` through ``write(tmp_path)`` into a temporary file in the same folder, then
    rename it into place (a crash leaves no torn file). The file gets ``0o666 & ~umask``
    permissions, as ``open()`` would give it (``mkstemp`` alone makes it 0600)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def save_tensors(path: Path, tensors: Mapping[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """``safetensors`` file of contiguous CPU copies of ``tensors`` (atomic, umask-respecting)."""
    data = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    atomic_write(path, lambda p: save_file(data, p, metadata={"format": "pt", **(metadata or {})}))


def write_json(path: Path, data: dict) -> None:
    """Pretty JSON file (atomic, umask-respecting)."""
    atomic_write(path, lambda p: Path(p).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8"))

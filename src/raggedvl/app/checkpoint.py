"""Atomic, verified, code-free training checkpoints.

Layout of one checkpoint (``<run>/checkpoints/step-000050/``)::

    raggedvl_retriever.safetensors
                          the retriever's weights (unsharded; with LoRA on a named base only
                          the adapters and the head; ``model.safetensors`` in older runs)  safetensors
    raggedvl_retriever.json, processor files
                          the retriever's settings and its processor: the folder loads with
                          ``build_retriever`` / ``raggedvl export`` / ``--model``   JSON
    optimizer.pt          full optimizer state dict                     torch.save, loaded weights_only
    rng.pt                per-rank torch / python RNG states            torch.save, loaded weights_only
    trainer_state.json    step, epoch, sampler and scheduler state, config, run counters
    MANIFEST.json         size and SHA-256 of every file above, written last

Writing: rank 0 writes into ``step-000050.tmp-<pid>``, fsyncs, writes the manifest, then
renames the folder into place (``os.rename`` is atomic on POSIX) and only then removes the
oldest checkpoints beyond ``keep``. A crash at any point leaves the previous checkpoint intact.
A write that fails (a full disk among other causes) removes its temporary folder, keeps every
older checkpoint and raises :class:`CheckpointError` saying "no space left" when that is the
cause; :func:`check_free_space` refuses a save up front when the disk cannot hold one more
checkpoint, and :func:`remove_stale_temporaries` clears the temporary folders that processes
killed while writing left behind.

Loading: checkpoints are tried newest first; one whose manifest is missing, or whose files
differ in size or hash, is reported and skipped, so a torn write falls back to the previous
good checkpoint. Nothing loaded executes code: weights come from safetensors, the rest from
JSON or ``torch.load(weights_only=True)``; a pickle that carries code is refused with
:class:`CheckpointError`.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pickle
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import load_file

from raggedvl.models.saved import WEIGHTS_NAME, weights_file
from raggedvl.models.weights import save_tensors
from raggedvl.app.rundir import checkpoint_folders

FILES = (WEIGHTS_NAME, "optimizer.pt", "rng.pt", "trainer_state.json")
MANIFEST = "MANIFEST.json"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, torn, corrupt or unsafe to load."""


@dataclass
class Checkpoint:
    path: Path
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    rng: list[dict[str, Any]]
    state: dict[str, Any]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def save_checkpoint(
    root: str | Path,
    step: int,
    *,
    model_state: dict[str, torch.Tensor],
    optimizer_state: dict[str, Any],
    rng_states: list[dict[str, Any]],
    trainer_state: dict[str, Any],
    keep: int = 2,
    extra_files: Callable[[Path], None] | None = None,
) -> Path:
    """Write one checkpoint atomically under ``root`` (call on rank 0 only); returns its path.

    ``model_state`` tensors are cloned to contiguous CPU tensors (safetensors refuses shared
    storage, e.g. tied embeddings). ``extra_files(folder)`` writes more files into the
    checkpoint before the manifest (the retriever's settings and processor); the manifest
    covers them too. Raises ``ValueError`` if ``keep < 1``.
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / step_dir_name(step)
    tmp = root / f"{final.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        _write_files(tmp, step, model_state, optimizer_state, rng_states, trainer_state, extra_files)
    except (OSError, RuntimeError) as exc:  # torch.save reports a full disk as a RuntimeError
        shutil.rmtree(tmp, ignore_errors=True)
        free = shutil.disk_usage(root).free
        cause = "no space left on the device" if _out_of_space(exc) else f"{type(exc).__name__}: {exc}"
        raise CheckpointError(
            f"writing the checkpoint of step {step} into {root} failed ({cause}; {free:,} bytes free); nothing of it "
            "was kept and older checkpoints are untouched; free space or choose another --output-dir, then --resume"
        ) from exc
    if final.exists():  # a re-run of the same step replaces its older copy atomically
        old = root / f"{final.name}.old-{os.getpid()}"
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old)
    else:
        os.rename(tmp, final)
    _fsync_dir(root)
    for stale in list_checkpoints(root)[keep:]:
        shutil.rmtree(stale, ignore_errors=True)
    return final


def _write_files(tmp: Path, step: int, model_state, optimizer_state, rng_states, trainer_state, extra_files) -> None:
    # save_tensors: safetensors' own writer makes 0600 files; this one respects the umask
    save_tensors(tmp / WEIGHTS_NAME, {k: v.detach().to("cpu").clone() for k, v in model_state.items()})
    torch.save(optimizer_state, tmp / "optimizer.pt")
    torch.save(rng_states, tmp / "rng.pt")
    (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=2, sort_keys=True), encoding="utf-8")
    if extra_files is not None:
        extra_files(tmp)
    manifest = {}
    for name in sorted(p.name for p in tmp.iterdir() if p.is_file()):
        p = tmp / name
        with open(p, "rb+") as f:
            os.fsync(f.fileno())
        manifest[name] = {"bytes": p.stat().st_size, "sha256": _sha256(p)}
    (tmp / MANIFEST).write_text(json.dumps({"step": step, "files": manifest}, indent=2), encoding="utf-8")
    _fsync_dir(tmp)


def _out_of_space(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) is a full disk: ``ENOSPC`` / ``EDQUOT``, or torch's
    writer failing at a file position ("unexpected pos"), which is how it reports one."""
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "unexpected pos" in str(exc) or "No space left" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def checkpoint_bytes(path: Path) -> int:
    """Bytes of the files of one checkpoint folder."""
    return sum(p.stat().st_size for p in Path(path).iterdir() if p.is_file())


def check_free_space(root: str | Path, step: int, estimate_bytes: int) -> None:
    """Raise :class:`CheckpointError` (one line: the folder, free and needed bytes, the fix) when
    the filesystem of ``root`` has less free space than one more checkpoint needs: the newest
    checkpoint's size, else ``estimate_bytes`` (the weights and optimizer state to write)."""
    root = Path(root)
    existing = list_checkpoints(root) if root.is_dir() else []
    needed = checkpoint_bytes(existing[0]) if existing else int(estimate_bytes)
    probe = root if root.exists() else next(p for p in root.parents if p.exists())
    free = shutil.disk_usage(probe).free
    if free < needed:
        raise CheckpointError(
            f"no space left for the checkpoint of step {step} in {root}: {free:,} bytes free, {needed:,} needed "
            f"({'the size of ' + existing[0].name if existing else 'weights and optimizer state'}); free space or "
            "choose another --output-dir, then --resume (older checkpoints are untouched)")


def remove_stale_temporaries(root: str | Path) -> list[Path]:
    """Remove the ``*.tmp-<pid>`` / ``*.old-<pid>`` folders a killed writer left in ``root``
    (call before any save of this run); returns what was removed."""
    root = Path(root)
    stale = sorted(p for p in root.glob("step-*.*-*") if p.is_dir() and (".tmp-" in p.name or ".old-" in p.name))
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale


def list_checkpoints(root: str | Path) -> list[Path]:
    """Checkpoint folders under ``root``, newest step first (temporary folders excluded;
    :func:`raggedvl.app.rundir.checkpoint_folders`, which needs no torch)."""
    return checkpoint_folders(root)


def verify_checkpoint(path: str | Path) -> None:
    """Raise :class:`CheckpointError` unless every file matches the manifest's size and SHA-256."""
    path = Path(path)
    mpath = path / MANIFEST
    if not mpath.is_file():
        raise CheckpointError(f"{path}: no {MANIFEST}; the write was interrupted before it completed")
    try:
        manifest = json.loads(mpath.read_text(encoding="utf-8"))["files"]
    except (ValueError, KeyError) as e:
        raise CheckpointError(f"{mpath}: unreadable manifest ({e})") from e
    required = set(FILES) if WEIGHTS_NAME in manifest else set(FILES) - {WEIGHTS_NAME} | {"model.safetensors"}  # older: legacy name
    for name in sorted(required | set(manifest)):
        p = path / name
        want = manifest.get(name)
        if want is None or not p.is_file():
            raise CheckpointError(f"{path}: {name} is missing")
        size = p.stat().st_size
        if size != want["bytes"]:
            raise CheckpointError(f"{p}: {size} bytes, manifest says {want['bytes']} (truncated or overwritten)")
        if _sha256(p) != want["sha256"]:
            raise CheckpointError(f"{p}: SHA-256 differs from the manifest (corrupt)")


def _safe_torch_load(path: Path) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"{path}: refusing to load: the file contains pickled objects other than tensors and plain "
            f"containers (possibly code). raggedvl only loads weights_only data. Details: {e}"
        ) from e


def load_checkpoint(path: str | Path, *, verify: bool = True) -> Checkpoint:
    """Verify (unless the caller just did: ``verify=False``) and load one checkpoint folder.
    Raises :class:`CheckpointError`."""
    path = Path(path)
    if verify:
        verify_checkpoint(path)
    return Checkpoint(
        path=path,
        model=load_file(str(weights_file(path))),
        optimizer=_safe_torch_load(path / "optimizer.pt"),
        rng=_safe_torch_load(path / "rng.pt"),
        state=json.loads((path / "trainer_state.json").read_text(encoding="utf-8")),
    )


def latest_verified_checkpoint(root: str | Path) -> tuple[Path | None, list[str]]:
    """The newest checkpoint folder under ``root`` that verifies (files hashed, nothing loaded),
    and a message for each newer one skipped; ``(None, problems)`` when none verifies."""
    problems: list[str] = []
    for path in list_checkpoints(root):
        try:
            verify_checkpoint(path)
        except CheckpointError as e:
            problems.append(str(e))
            continue
        return path, problems
    return None, problems


def load_latest_checkpoint(root: str | Path) -> tuple[Checkpoint | None, list[str]]:
    """The newest checkpoint under ``root`` that verifies, and a message for each one skipped.

    Returns ``(None, problems)`` when there is no valid checkpoint. A refused (unsafe) file
    is not skipped silently: :class:`CheckpointError` for unsafe content propagates.
    """
    path, problems = latest_verified_checkpoint(root)
    return (None if path is None else load_checkpoint(path, verify=False)), problems  # hashed once, just above


def find_checkpoint(path: str | Path) -> Path:
    """``path`` itself when it is a checkpoint folder (verified); else the newest checkpoint that
    verifies in a run directory (``<path>/checkpoints``) or a checkpoints folder, each skipped one
    reported on stderr (``warning: skipped checkpoint: ...``, as ``--resume`` does). Only hashes
    files: nothing is loaded.

    Raises :class:`CheckpointError` when there is no checkpoint or none verifies."""
    path = Path(path)
    if (path / MANIFEST).exists() or weights_file(path) is not None:
        verify_checkpoint(path)
        return path
    root = path / "checkpoints" if list_checkpoints(path / "checkpoints") else path
    found, problems = latest_verified_checkpoint(root)
    for problem in problems:
        print(f"warning: skipped checkpoint: {problem}", file=sys.stderr)
    if found is not None:
        return found
    if problems:
        raise CheckpointError(f"{path}: no checkpoint verifies: " + "; ".join(problems))
    raise CheckpointError(f"{path}: neither a checkpoint folder nor a run directory with checkpoints/step-*")


def load_checkpoint_or_latest(path: str | Path) -> Checkpoint:
    """:func:`find_checkpoint`, loaded. Raises :class:`CheckpointError`."""
    return load_checkpoint(find_checkpoint(path), verify=False)

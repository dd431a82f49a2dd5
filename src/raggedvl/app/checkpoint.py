"""Atomic, verified, code-free, sharded training checkpoints.

Layout of one checkpoint (``<run>/checkpoints/step-000050/``)::

    model/                the retriever's weights (with LoRA on a named base only the adapters
                          and the head)                  torch.distributed.checkpoint (DCP) folder
    optimizer/            the optimizer state, sharded like the parameters          DCP folder
    raggedvl_retriever.json, processor files
                          the retriever's settings and its processor: ``raggedvl export`` /
                          ``eval`` / ``--model`` load the folder (:func:`as_retriever_folder`)  JSON
    rng.pt                per-rank torch / python RNG states            torch.save, loaded weights_only
    trainer_state.json    step, epoch, world size, sampler and scheduler state, config, run counters
    MANIFEST.json         size and SHA-256 of every file above (paths relative to the folder), written last

A DCP folder holds ``.metadata`` and one ``__R_0.distcp`` per rank R
(``raggedvl.parallel.sharded_state``): every rank writes its own shards in parallel and no rank
gathers the model or the optimizer state. Checkpoints of older raggedvl versions hold
``raggedvl_retriever.safetensors`` (or ``model.safetensors``) and ``optimizer.pt`` instead of
the two folders, and ``build_retriever`` loads them directly; they load as before.

Writing (:func:`save_checkpoint`, a collective): rank 0 makes ``step-000050.tmp-<pid>``, every
rank writes its shards into it and hashes the files it wrote (SHA-256), rank 0 writes the
small files, records every rank's hashes and its own in the manifest, fsyncs, renames the folder
into place (``os.rename`` is atomic on POSIX) and only then removes the oldest checkpoints beyond
``keep``. Ranks on several nodes need one shared filesystem for the run directory. A crash at any
point leaves the previous checkpoint intact. A write that fails on any rank (a full disk among
other causes) removes the temporary folder, keeps every older checkpoint and raises
:class:`CheckpointError` on every rank, saying "no space left" when that is the cause;
:func:`check_free_space` refuses a save up front when the disk cannot hold one more checkpoint,
and :func:`remove_stale_temporaries` clears the temporary folders that processes killed while
writing left behind. :func:`start_checkpoint` and :func:`finish_checkpoint` are the two halves
of a save: between them the shards may be written in the background (``--async-checkpoint``).

Loading: checkpoints are tried newest first; one whose manifest is missing, or whose files
differ in size or hash, is reported and skipped, so a torn write falls back to the previous
good checkpoint (``shared=True``: the hashing is split over the ranks, each reads a share of the
files). Nothing loaded executes code: weights come from DCP files or safetensors, the rest from
JSON or ``torch.load(weights_only=True)``; a pickle that carries code is refused with
:class:`CheckpointError`.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import json
import os
import pickle
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from safetensors.torch import load_file

from raggedvl.models.saved import WEIGHTS_NAME, weights_file
from raggedvl.models.weights import save_tensors
from raggedvl.parallel import (
    BackgroundWrite,
    all_gather_objects,
    check_metadata,
    get_rank,
    get_world_size,
    read_full_state,
    write_sharded,
)
from raggedvl.app.rundir import MANIFEST, checkpoint_folders

OLDER_FILES = (WEIGHTS_NAME, "optimizer.pt", "rng.pt", "trainer_state.json")  # the single-file layout
SHARDED = ("model", "optimizer")  # the DCP folders of a checkpoint
FILES = tuple(f"{name}/.metadata" for name in SHARDED) + ("rng.pt", "trainer_state.json")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, torn, corrupt or unsafe to load."""


@dataclass
class Checkpoint:
    """The small files of a checkpoint; the weights are read by :func:`checkpoint_weights`, the
    sharded state by the ranks (``raggedvl.app.checkpointer.Checkpointer.resume``)."""

    path: Path
    rng: list[dict[str, Any]]
    state: dict[str, Any]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _entry(path: Path) -> dict[str, Any]:
    return {"bytes": path.stat().st_size, "sha256": _sha256(path)}


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def is_sharded(path: str | Path) -> bool:
    """Whether the checkpoint folder ``path`` holds DCP folders (else the older single-file layout)."""
    return (Path(path) / SHARDED[0] / ".metadata").is_file()


@dataclass
class CheckpointContents:
    """What one checkpoint holds (the layout above), as each rank passes it to :func:`save_checkpoint`."""

    model_state: dict[str, Any]  # this rank's (``raggedvl.parallel.sharded_state_dicts``: DTensor shards
    optimizer_state: dict[str, Any]  # under FSDP2, the tensors themselves under DDP)
    rng_states: list[dict[str, Any]]  # every rank's, indexed by rank (used on rank 0)
    trainer_state: dict[str, Any]  # trainer_state.json (used on rank 0)
    extra_files: Callable[[Path], None] | None = None  # rank 0: more files for the folder, before the manifest


def save_checkpoint(root: str | Path, step: int, contents: CheckpointContents, *, keep: int = 2) -> Path:
    """Write one checkpoint atomically under ``root``; returns its path on every rank.

    Collective under a process group: every rank calls it with its own ``contents`` (DCP writes
    each tensor replicated under DDP once); the collectives are DCP's and three
    ``all_gather_objects`` (the folder, the hashes, the outcome). Raises ``ValueError`` if
    ``keep < 1``, :class:`CheckpointError` on every rank when any rank's write fails (nothing of
    the checkpoint is kept).
    """
    return finish_checkpoint(start_checkpoint(root, step, contents, keep=keep))


@dataclass
class PendingCheckpoint:
    """A checkpoint whose shards are being written (:func:`start_checkpoint`)."""

    root: Path
    step: int
    tmp: Path
    written: Callable[[], list[Path]]  # this rank's files once written; raises what the write raised
    contents: CheckpointContents
    keep: int


def start_checkpoint(root: str | Path, step: int, contents: CheckpointContents, *, keep: int = 2,
                     background: tuple[Any, bool] | None = None) -> PendingCheckpoint:
    """The first half of :func:`save_checkpoint` (same arguments): the temporary folder and the
    shards. ``background = (group, pinned)``: the shards are copied to host memory now and
    written in a background thread over ``group`` (``raggedvl.parallel.checkpoint_group``;
    ``raggedvl.parallel.BackgroundWrite``), so this returns before they are on disk; else they
    are written before it returns. :func:`finish_checkpoint` completes either. Collective."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    root = Path(root)
    tmp = root / f"{step_dir_name(step)}.tmp-{os.getpid()}"
    problem = None
    if get_rank() == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
        except OSError as exc:
            problem = _write_failed(root, step, exc)
    tmp_name, problem = all_gather_objects((str(tmp), problem))[0]  # rank 0's folder (pids differ)
    if problem is not None:
        raise CheckpointError(problem)
    tmp = Path(tmp_name)
    writes = [(tmp / name, state) for name, state in zip(SHARDED, (contents.model_state, contents.optimizer_state))]
    if background is not None:
        written = BackgroundWrite(writes, background[0], pinned=background[1]).result
    else:
        try:
            outcome: list[Path] | BaseException = [path for folder, state in writes for path in write_sharded(folder, state)]
        except (OSError, RuntimeError) as exc:  # DCP's save raises on every rank when one rank's write fails
            outcome = exc
        written = functools.partial(_returned, outcome)
    return PendingCheckpoint(root, step, tmp, written, contents, keep)


def _returned(outcome: list[Path] | BaseException) -> list[Path]:
    if isinstance(outcome, BaseException):
        raise outcome
    return outcome


def finish_checkpoint(pending: PendingCheckpoint) -> Path:
    """Wait for the shards of ``pending``, hash this rank's files, and on rank 0 write the small
    files and the manifest, rename the folder into place and rotate; returns the checkpoint's
    path on every rank. Collective (two ``all_gather_objects``). Raises
    :class:`CheckpointError` on every rank when any rank's write failed (the temporary folder
    is removed, older checkpoints are untouched)."""
    hashes: dict[str, Any] = {}
    failure = None
    try:
        for path in pending.written():  # each rank hashes its own files
            hashes[path.relative_to(pending.tmp).as_posix()] = _entry(path)
    except (OSError, RuntimeError) as exc:
        failure = (f"{type(exc).__name__}: {exc}", _out_of_space(exc))
    reports = all_gather_objects((hashes, failure))
    final = pending.root / step_dir_name(pending.step)
    problem = None
    if get_rank() == 0:
        problem = _finish(pending, final, reports)
    problem = all_gather_objects(problem)[0]
    if problem is not None:
        raise CheckpointError(problem)
    return final


def _finish(pending: PendingCheckpoint, final: Path, reports: list[Any]) -> str | None:
    """Rank 0's part of :func:`save_checkpoint` once every rank wrote its shards: the small files,
    the manifest, the rename and the rotation; the problem to raise on every rank, or None."""
    root, tmp = pending.root, pending.tmp
    failures = [(f"rank {rank}: {f[0]}", f[1]) for rank, (_, f) in enumerate(reports) if f is not None]
    try:
        if failures:
            raise _ShardsFailed(failures)
        shard_hashes = {name: entry for hashes, _ in reports for name, entry in hashes.items()}
        _write_files(tmp, pending.step, shard_hashes, pending.contents)
        if final.exists():  # a re-run of the same step replaces its older copy atomically
            old = root / f"{final.name}.old-{os.getpid()}"
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old)
        else:
            os.rename(tmp, final)
        _fsync_dir(root)
    except (OSError, RuntimeError) as exc:  # torch.save reports a full disk as a RuntimeError
        shutil.rmtree(tmp, ignore_errors=True)
        return _write_failed(root, pending.step, exc)
    for stale in list_checkpoints(root)[pending.keep:]:
        shutil.rmtree(stale, ignore_errors=True)
    return None


class _ShardsFailed(RuntimeError):
    """Some rank's shard write failed: ``failures`` is [(what, out of space)]."""

    def __init__(self, failures: list[tuple[str, bool]]) -> None:
        super().__init__("; ".join(what for what, _ in failures))
        self.out_of_space = any(full for _, full in failures)


def _write_failed(root: Path, step: int, exc: BaseException) -> str:
    """The one-line problem of a failed checkpoint write."""
    full = exc.out_of_space if isinstance(exc, _ShardsFailed) else _out_of_space(exc)
    free = shutil.disk_usage(root if root.exists() else next(p for p in root.parents if p.exists())).free
    cause = "no space left on the device" if full else f"{type(exc).__name__}: {exc}"
    return (f"writing the checkpoint of step {step} into {root} failed ({cause}; {free:,} bytes free); nothing of it "
            "was kept and older checkpoints are untouched; free space or choose another --output-dir, then --resume")


def _write_files(tmp: Path, step: int, shard_hashes: dict[str, Any], contents: CheckpointContents) -> None:
    """Rank 0's files, then the manifest: the ranks' ``shard_hashes`` and a hash of every other
    file (the DCP metadata, the RNG states, the trainer state, the settings and processor)."""
    torch.save(contents.rng_states, tmp / "rng.pt")
    (tmp / "trainer_state.json").write_text(json.dumps(contents.trainer_state, indent=2, sort_keys=True),
                                            encoding="utf-8")
    if contents.extra_files is not None:
        contents.extra_files(tmp)
    manifest = dict(shard_hashes)
    for p in sorted(p for p in tmp.rglob("*") if p.is_file()):
        name = p.relative_to(tmp).as_posix()
        if name not in manifest:
            with open(p, "rb+") as f:
                os.fsync(f.fileno())
            manifest[name] = _entry(p)
    (tmp / MANIFEST).write_text(json.dumps({"step": step, "files": dict(sorted(manifest.items()))}, indent=2),
                                encoding="utf-8")
    for folder in (tmp / name for name in SHARDED):
        _fsync_dir(folder)
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
    """Bytes of the files of one checkpoint folder, its DCP folders included."""
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


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
        then = ("then --resume (older checkpoints are untouched)" if existing else
                "then start the run again (it has no checkpoint to resume)")
        raise CheckpointError(
            f"no space left for the checkpoint of step {step} in {root}: {free:,} bytes free, {needed:,} needed "
            f"({'the size of ' + existing[0].name if existing else 'weights and optimizer state'}); free space or "
            f"choose another --output-dir, {then}")


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


def verify_checkpoint(path: str | Path, *, part: tuple[int, int] = (0, 1)) -> None:
    """Raise :class:`CheckpointError` unless every file has the manifest's size and the files of
    ``part`` its SHA-256. ``part = (i, n)``: of the files in name order, those whose position
    is i modulo n are hashed (n ranks verifying together each read 1/n of the checkpoint)."""
    path = Path(path)
    mpath = path / MANIFEST
    if not mpath.is_file():
        raise CheckpointError(f"{path}: no {MANIFEST}; the write was interrupted before it completed")
    try:
        manifest = json.loads(mpath.read_text(encoding="utf-8"))["files"]
    except (ValueError, KeyError) as e:
        raise CheckpointError(f"{mpath}: unreadable manifest ({e})") from e
    if FILES[0] in manifest:
        required = set(FILES)
    elif WEIGHTS_NAME in manifest:
        required = set(OLDER_FILES)
    else:  # the oldest layout: model.safetensors
        required = set(OLDER_FILES) - {WEIGHTS_NAME} | {"model.safetensors"}
    index, count = part
    for position, name in enumerate(sorted(required | set(manifest))):
        p = path / name
        want = manifest.get(name)
        if want is None or not p.is_file():
            raise CheckpointError(f"{path}: {name} is missing")
        size = p.stat().st_size
        if size != want["bytes"]:
            raise CheckpointError(f"{p}: {size} bytes, manifest says {want['bytes']} (truncated or overwritten)")
        if position % count == index and _sha256(p) != want["sha256"]:
            raise CheckpointError(f"{p}: SHA-256 differs from the manifest (corrupt)")


def verify_checkpoint_shared(path: str | Path) -> None:
    """:func:`verify_checkpoint` split over the ranks (each hashes its share of the files), with
    one verdict on every rank: the first problem any rank found, raised as
    :class:`CheckpointError`. Collective (one ``all_gather_objects``); without a process group
    :func:`verify_checkpoint`."""
    try:
        verify_checkpoint(path, part=(get_rank(), get_world_size()))
        problem = None
    except CheckpointError as exc:
        problem = str(exc)
    problems = [p for p in all_gather_objects(problem) if p is not None]
    if problems:
        raise CheckpointError(problems[0])


def _safe_torch_load(path: Path) -> Any:
    return _refuse_unpicklable(lambda p: torch.load(p, map_location="cpu", weights_only=True), path)


def _refuse_unpicklable(read: Callable[[Path], Any], path: Path) -> Any:
    """``read(path)``, a ``pickle.UnpicklingError`` (a class that is no data) as :class:`CheckpointError`."""
    try:
        return read(path)
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"{path}: refusing to load: the file contains pickled objects other than tensors and plain "
            f"containers (possibly code). raggedvl only loads weights_only data. Details: {e}"
        ) from e


def load_checkpoint(path: str | Path, *, verify: bool = True) -> Checkpoint:
    """Verify (unless the caller just did: ``verify=False``) and load the small files of one
    checkpoint folder. Raises :class:`CheckpointError`."""
    path = Path(path)
    if verify:
        verify_checkpoint(path)
    if is_sharded(path):
        for name in SHARDED:
            _refuse_unpicklable(check_metadata, path / name)
    return Checkpoint(
        path=path,
        rng=_safe_torch_load(path / "rng.pt"),
        state=json.loads((path / "trainer_state.json").read_text(encoding="utf-8")),
    )


def checkpoint_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """The retriever's weights of one (verified) checkpoint folder, whole, in this process: the
    ``model/`` DCP folder consolidated from every rank's shards (no process group needed), or
    the safetensors file of the single-file layout. With LoRA on a named base: the adapters and
    the head only."""
    path = Path(path)
    if is_sharded(path):
        return _refuse_unpicklable(read_full_state, path / SHARDED[0])
    return load_file(str(weights_file(path)))


@contextlib.contextmanager
def as_retriever_folder(path: str) -> Iterator[str]:
    """A sharded checkpoint folder as a saved retriever (``build_retriever`` loads it): a
    temporary folder, removed on exit, holding its settings and processor files and
    ``raggedvl_retriever.safetensors`` with the weights consolidated in this process
    (:func:`checkpoint_weights`); any other model source (a folder, a hub id, a preset) as given.
    Call it on a verified checkpoint."""
    if not is_sharded(path):
        yield path
        return
    path = Path(path)
    with tempfile.TemporaryDirectory(prefix="raggedvl-consolidated-") as tmp:
        for p in path.iterdir():
            if p.is_file() and p.name not in (MANIFEST, "rng.pt", "trainer_state.json"):
                shutil.copy2(p, tmp)
        save_tensors(Path(tmp) / WEIGHTS_NAME, checkpoint_weights(path))
        yield tmp


def load_older_state(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(weights, optimizer state) of a (verified) checkpoint of the single-file layout, whole."""
    path = Path(path)
    return load_file(str(weights_file(path))), _safe_torch_load(path / "optimizer.pt")


def latest_verified_checkpoint(root: str | Path, *, shared: bool = False) -> tuple[Path | None, list[str]]:
    """The newest checkpoint folder under ``root`` that verifies (files hashed, nothing loaded),
    and a message for each newer one skipped; ``(None, problems)`` when none verifies.
    ``shared``: verified by all ranks together (:func:`verify_checkpoint_shared`, a collective:
    every rank calls it)."""
    problems: list[str] = []
    for path in list_checkpoints(root):
        try:
            verify_checkpoint_shared(path) if shared else verify_checkpoint(path)
        except CheckpointError as e:
            problems.append(str(e))
            continue
        return path, problems
    return None, problems


def load_latest_checkpoint(root: str | Path, *, shared: bool = False) -> tuple[Checkpoint | None, list[str]]:
    """The newest checkpoint under ``root`` that verifies (``shared``: as in
    :func:`latest_verified_checkpoint`), and a message for each one skipped.

    Returns ``(None, problems)`` when there is no valid checkpoint. A refused (unsafe) file
    is not skipped silently: :class:`CheckpointError` for unsafe content propagates.
    """
    path, problems = latest_verified_checkpoint(root, shared=shared)
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

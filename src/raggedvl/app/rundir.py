"""The output directory of ``raggedvl train``, checked without torch: the launcher runs
:func:`check_output_dir` before torch is imported, and every rank runs it again before any
collective (all ranks see the same directory, so all raise together).

A checkpoint folder is ``<output_dir>/checkpoints/step-N`` or ``<output_dir>/best/step-N``;
temporary folders (a name with a ``.``, e.g. ``step-4.tmp-123``) are ignored, as
``raggedvl.app.checkpoint.list_checkpoints`` (this module's :func:`checkpoint_folders`) ignores them.
"""

from __future__ import annotations

import os
from pathlib import Path

MANIFEST = "MANIFEST.json"  # a checkpoint folder's list of files and their digests


def checkpoint_folders(root: str | Path) -> list[Path]:
    """Checkpoint folders (``step-N``) under ``root``, newest step first; [] when ``root`` is
    not a folder (``raggedvl.app.checkpoint.list_checkpoints`` is this function)."""
    root = Path(root)
    if not root.is_dir():
        return []
    dirs = [p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-") and "." not in p.name
            and p.name[len("step-"):].isdigit()]
    return sorted(dirs, key=lambda p: int(p.name.split("-")[1]), reverse=True)


def results_folder(path: str | Path) -> Path:
    """Where ``raggedvl eval`` writes results for the model at ``path`` when ``--output`` is not
    given, known before the model loads: a training run's ``eval/`` folder (``path`` the run, its
    ``checkpoints/`` or ``best/`` folder, or one checkpoint in them), else the model folder's own
    ``eval/``."""
    path = Path(path).expanduser()
    if (path / MANIFEST).exists():
        return path.resolve().parent.parent / "eval"
    if not (path / "checkpoints").is_dir() and checkpoint_folders(path):
        return path.resolve().parent / "eval"
    return path / "eval"


def check_writable(out: Path, flag: str = "--output-dir", *, default: bool = False) -> None:
    """Raise ``ValueError`` (one line, naming ``flag``) when files cannot be created in the
    folder ``out`` (or, while it does not exist, in its nearest existing parent): a path that is
    or lies below a file, a read-only filesystem or folder. ``default``: ``out`` is where the
    command writes when ``flag`` is not given, and the message says to give ``flag``. Creates and
    removes one empty probe file."""
    import tempfile

    probe = Path(out).expanduser()
    who = f"the default output folder {str(out)!r}" if default else f"{flag} {str(out)!r}"
    fix = f"give {flag} in a writable folder" if default else f"choose a writable {flag}"
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise ValueError(f"{who}: {str(probe)!r} is a file, not a folder; "
                         + (fix if default else f"choose another {flag}"))
    try:
        fd, name = tempfile.mkstemp(prefix=".raggedvl-probe-", dir=probe)
        os.close(fd)
        os.unlink(name)
    except OSError as exc:
        raise ValueError(f"{who}: cannot write in {str(probe)!r} ({exc.strerror or exc}); {fix}") from None


def check_new_folder(out: str | Path, command: str, flag: str = "--output") -> None:
    """Raise ``ValueError`` (one line, naming ``flag``, a few of the entries and the fix) when the
    folder ``out`` already holds files or folders: ``raggedvl <command>`` writes only into a
    missing or empty folder, so its files are never mixed with others. Reads only the listing."""
    out = Path(out).expanduser()
    entries = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if entries:
        shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
        raise ValueError(f"{flag} {str(out)!r} is not empty (it holds {shown}); {command} into a new folder")


def check_output_file(path: Path, flag: str = "--output") -> None:
    """Raise ``ValueError`` (one line, naming ``flag``) when the file ``path`` cannot be written:
    it is a folder, or its folder cannot be created or written (:func:`check_writable`)."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise ValueError(f"{flag} {str(path)!r} is a folder; give a file name, e.g. {str(path / 'results.json')!r}")
    check_writable(path.parent, flag)


def check_output_dir(cfg) -> None:
    """Refuse to start a fresh run (``cfg.resume`` unset) in ``cfg.output_dir`` when it holds
    another run's checkpoints (they would be mixed with this run's). Raises ``ValueError``
    naming the checkpoints and the fix (``--resume`` or a new ``--output-dir``). Reads only the
    directory listing; imports nothing heavy."""
    out = Path(cfg.output_dir)
    check_writable(out)
    found = checkpoint_folders(out / "checkpoints") + checkpoint_folders(out / "best")
    if found and not cfg.resume:
        raise ValueError(
            f"{cfg.output_dir} already holds checkpoints of a run ({', '.join(p.name for p in found)}); "
            "pass --resume to continue it, or choose a new --output-dir"
        )

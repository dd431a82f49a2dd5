"""Which files of a local folder make which split, by ``datasets``' default rules, without
importing ``datasets`` (it pulls pandas: ~110 MiB and ~0.8 s per process).

:func:`resolve_splits` gives, for the layouts it can decide exactly, what
``DataFilesDict.from_patterns(get_data_patterns(folder))`` gives (``datasets`` 5, fsspec
>= 2023.12): split -> files, the splits and the files in the same order (a multi-file split's
rows follow it). It returns None ("undecided": the caller asks ``datasets``) for anything else.

Decided layouts: the folder's visible entries (see below) are files, plus at most one folder
``data/`` whose visible entries are files.

* ``data/`` holds hub shards (``data/*-NNNNN-of-NNNNN*.*``): when each of them is
  ``<split>-NNNNN-of-NNNNN.<ext>`` (``<split>`` letters, digits, ``_``), the splits are their
  ``<split>`` names (train, validation, test first, then the others sorted), each its shards
  sorted; every other file is left out (``datasets`` looks no further).
* Else, by file name: a file whose name starts with a split keyword followed by one of
  ``NON_WORDS_CHARS``, or holds one between two of them (``train.parquet``, ``dev-0.parquet``,
  ``my_test_1.csv``; case-sensitive), belongs to that split; splits in the order train,
  validation, test; a split's files pattern by pattern (``datasets``' order of
  ``DEFAULT_PATTERNS_SPLIT_IN_FILENAME``), sorted by path within a pattern; files without a
  keyword are left out. Undecided when a file matches two splits (``train-test.csv``) or two
  patterns of one split (``train_train.csv``, listed twice by ``datasets``).
* No file with a keyword: one split "train", every file sorted by path.

Invisible, as for ``datasets``: names starting with ``.`` (files and folders, with their
contents: the ``.raggedvl`` cache folder), folders starting with ``__``, the files named in
``FILES_TO_IGNORE``. Undecided: any other folder, a symbolic link to anything but a file,
another kind of entry, a file ``*.eval``, ``task.toml`` or ``instruction.md`` (``datasets``'
"logs" and "harbor" layouts), a folder path holding glob characters or ``::``, no visible file,
a platform other than POSIX, another major version of ``datasets``, fsspec before 2023.12.

Shapes and units: paths are ``str``, ``<resolved folder>/<relative path>``, as ``datasets``
writes them.
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path

# Copies of datasets.data_files' values (tests/data/test_split_rules.py checks them).
SPLIT_KEYWORDS = {
    "train": ("train", "training"),
    "validation": ("validation", "valid", "dev", "val"),
    "test": ("test", "testing", "eval", "evaluation"),
}
NON_WORDS_CHARS = "-._ 0-9"
SPLIT_PATTERN_SHARDED = (
    "data/{split}-[0-9][0-9][0-9][0-9][0-9]-of-[0-9][0-9][0-9][0-9][0-9]*.*"
)
# datasets' patterns for fsspec >= 2023.12 (earlier fsspec: other patterns, undecided)
KEYWORDS_IN_FILENAME_BASE_PATTERNS = (
    "**/{keyword}[{sep}]*",
    "**/*[{sep}]{keyword}[{sep}]*",
)
FILES_TO_IGNORE = (
    "README.md",
    "config.json",
    "dataset_info.json",
    "dataset_infos.json",
    "dummy_data.zip",
    "dataset_dict.json",
)
DEFAULT_SPLITS = ("train", "validation", "test")
# datasets' "harbor" layout (its "logs" layout: *.eval files): a folder holding one is undecided
OTHER_LAYOUT_NAMES = ("task.toml", "instruction.md")
VERIFIED_DATASETS_MAJOR = 5  # the datasets whose rules these are

_SEP = f"[{NON_WORDS_CHARS}]"
# Per split, one regex per glob of DEFAULT_PATTERNS_SPLIT_IN_FILENAME, in its order, matched on a
# file's name ("**/" takes any folders; "*" any characters but "/").
_NAME_PATTERNS = {
    split: tuple(
        re.compile(regex, re.S)
        for keyword in keywords
        for regex in (f"{keyword}{_SEP}.*", f".*{_SEP}{keyword}{_SEP}.*")
    )
    for split, keywords in SPLIT_KEYWORDS.items()
}
# SPLIT_PATTERN_SHARDED with split "*", on a name in data/
_SHARD_GLOB = re.compile(r"[^/]*-[0-9]{5}-of-[0-9]{5}[^/]*\.[^/]*", re.S)
_SHARD = re.compile(r"([A-Za-z0-9_]+)-[0-9]{5}-of-[0-9]{5}\.[A-Za-z0-9]+")
_IGNORED = frozenset(FILES_TO_IGNORE)


@functools.cache
def _versions_verified() -> bool:
    """Whether the installed ``datasets`` and fsspec are those these rules copy (read from the
    package metadata: ``datasets`` is not imported)."""
    from importlib.metadata import PackageNotFoundError, version

    def release(name: str) -> tuple[int, ...]:
        return tuple(int(part) for part in re.findall(r"\d+", version(name))[:2])

    try:
        datasets_release, fsspec_release = release("datasets"), release("fsspec")
    except (PackageNotFoundError, ValueError):
        return False
    verified_datasets = datasets_release[:1] == (VERIFIED_DATASETS_MAJOR,)
    return verified_datasets and fsspec_release >= (2023, 12)


def _visible(folder: str) -> tuple[list[str], list[str]] | None:
    """The names of ``folder``'s visible files and folders, or None when an entry is something
    these rules do not decide (a symbolic link to anything but a file, a socket...)."""
    files, folders = [], []
    with os.scandir(folder) as entries:
        for entry in entries:
            name = entry.name
            if name.startswith("."):
                continue  # hidden: datasets leaves it (and anything inside) out
            if entry.is_symlink():
                if not os.path.isfile(entry.path):
                    return None
                kind = "file"
            elif entry.is_dir(follow_symlinks=False):
                kind = "folder"
            elif entry.is_file(follow_symlinks=False):
                kind = "file"
            else:
                return None
            if kind == "folder":
                if not name.startswith("__"):  # "__pycache__": datasets leaves it out
                    folders.append(name)
            elif name not in _IGNORED:
                files.append(name)
    return files, folders


def _by_name(paths: list[str]) -> dict[str, list[str]] | None:
    """Splits of ``paths`` (relative, sorted) by the keywords in their names; {} when no name
    holds one; None when a name matches two splits or two patterns of one split."""
    found: dict[str, list[list[str]]] = {
        split: [[] for _ in patterns] for split, patterns in _NAME_PATTERNS.items()
    }
    for path in paths:
        name = path.rsplit("/", 1)[-1]
        hits = [
            (split, i)
            for split, patterns in _NAME_PATTERNS.items()
            for i, pattern in enumerate(patterns)
            if pattern.fullmatch(name)
        ]
        if len(hits) > 1:
            return None
        if hits:
            split, i = hits[0]
            found[split][i].append(path)
    return {
        split: [p for per_pattern in lists for p in per_pattern]
        for split, lists in found.items()
        if any(lists)
    }


def _sharded(names: list[str]) -> dict[str, list[str]] | None:
    """Splits of the hub shards among ``names`` (files of ``data/``, sorted), as relative paths;
    {} when none is a shard; None when a shard's name is not plain ``<split>-NNNNN-of-NNNNN.<ext>``."""
    shards = [name for name in names if _SHARD_GLOB.fullmatch(name)]
    splits: dict[str, list[str]] = {}
    for name in shards:
        plain = _SHARD.fullmatch(name)
        if plain is None:
            return None
        splits.setdefault(plain.group(1), []).append(f"data/{name}")
    order = [s for s in DEFAULT_SPLITS if s in splits] + sorted(
        set(splits) - set(DEFAULT_SPLITS)
    )
    return {split: splits[split] for split in order}


def resolve_splits(folder: str | os.PathLike) -> dict[str, list[str]] | None:
    """Split name -> file paths of local folder ``folder`` as ``datasets`` infers them
    (module docstring), or None when undecided (then ``datasets`` decides)."""
    if os.name != "posix" or not _versions_verified():
        return None
    base = str(Path(folder).resolve())
    if any(c in base for c in "*?[]") or "::" in base or base == "/":
        return None
    try:
        top = _visible(base)
        if top is None or not set(top[1]) <= {"data"}:
            return None
        paths = top[0]
        if top[1]:
            inner = _visible(os.path.join(base, "data"))
            if inner is None or inner[1]:
                return None
            shards = _sharded(sorted(inner[0]))
            if shards is None:
                return None
            if shards:
                return {
                    split: [f"{base}/{p}" for p in files]
                    for split, files in shards.items()
                }
            paths = paths + [f"data/{name}" for name in inner[0]]
    except OSError:
        return None
    paths.sort()
    if not paths:
        return None
    names = [p.rsplit("/", 1)[-1] for p in paths]
    if any(
        n.lower().endswith(".eval") or n.lower() in OTHER_LAYOUT_NAMES for n in names
    ):
        return None
    splits = _by_name(paths)
    if splits is None:
        return None
    return {
        split: [f"{base}/{p}" for p in files]
        for split, files in (splits or {"train": paths}).items()
    }

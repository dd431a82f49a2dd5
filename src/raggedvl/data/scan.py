"""A local parquet dataset as the launcher sees it, without torch, transformers or ``datasets``'
arrow conversion: the split's files and columns (pyarrow), chosen columns, and every image's
size from its header, read in parallel and cached beside the data.

``parquet_split`` finds the parquet files of one split of a ``.parquet`` file or a folder (a
folder's splits inferred by ``datasets``' own file-name rules, so rows come in the order
``datasets.load_dataset`` gives them; ``split_rules`` applies them without importing
``datasets`` for the common layouts). ``image_sizes`` reads each row's image header (PIL, lazy
open: no pixel decoded) in worker processes over the files' row groups, and caches the result
in ``<data folder>/.raggedvl/sizes-<key>.npz``, the key a hash of each file's resolved path,
byte size and modification time, of the column and of ``SCAN_VERSION``, so a changed file is scanned again
(falls back to ``<cache root>/sizes/`` where the data folder is read-only). Rows whose header
cannot be read keep their reason, so a corrupt image is reported again from the cache.

Shapes and units: sizes are ``[N, 2]`` int64 (width, height) in pixels, EXIF orientation
applied, ``-1`` for an unreadable row; N counts the split's rows over all its files. A column of
several images per row (hard negatives: ``image_sizes(..., item="hard negative")``, or an
image column of positives: ``item="positive"``; each cell one image or a list) gives ``[N, K, 2]``, K the longest row, ``-1`` past a row's own images,
and ``counts`` [N], each row's number of images (0 for a null cell).

The cache is written only by the process that scans (``raggedvl train``'s launcher), through a
temporary file and ``os.replace``, so a rank reading it never sees a partial file.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import re
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np

from raggedvl.data.columns import ROLES, ColumnError, Columns
from raggedvl.suggest import closest

SCAN_VERSION = 3  # in the cache key: 2 added list columns (hard negatives); 3: a PNG without its IEND chunk is unreadable
_LABEL = "\x00"  # stands for the row's label in a stored reason; replaced when reported
PARALLEL_ROWS = 2048  # fewer rows are read in this process (worker start-up would dominate)


SPLIT_ALIASES = (("train", "training"), ("dev", "validation", "valid", "val"), ("test", "testing", "eval", "evaluation"))
"""Split names that ``datasets`` treats as one split when it infers splits from file names
(``dev.parquet`` becomes the "validation" split): a request for one finds any other."""


def pick_split(available: Sequence[str], split: str, where: str) -> str:
    """The name in ``available`` that means ``split`` (itself, or an alias from SPLIT_ALIASES).

    Raises ``ValueError`` naming the splits present and how split names are inferred."""
    if split in available:
        return split
    for group in SPLIT_ALIASES:
        if split in group:
            found = [name for name in group if name in available]
            if found:
                return found[0]
    raise ValueError(
        f"{where} has no split {split!r}; its splits: {sorted(available)}. Local files are split by name "
        "(train*, dev*/validation*, test*, or the hub layout data/<split>-*.parquet); a file whose name holds "
        "no split keyword is a training set only. raggedvl eval / encode: pass --split with one of the splits above; "
        "raggedvl train: pass --eval-split with one of them, evaluate on another file with --eval-dataset PATH, "
        "hold out a hash split with --eval-fraction F, or train without evaluation (--eval-before false "
        "--eval-after false)"
    )


def file_split(path: str | os.PathLike) -> str:
    """The split a single data file's NAME gives it, by ``datasets``' own keywords
    (``split_rules.SPLIT_KEYWORDS``, a copy of ``datasets.data_files.SPLIT_KEYWORDS``: a keyword
    at the start of the name or between non-word characters, case ignored):
    ``dev.parquet`` and ``my-validation-pairs.parquet`` are "validation",
    ``test_00.parquet`` is "test", and a name without a keyword (``pairs.parquet``) is "train",
    as ``datasets`` splits the files of a folder."""
    from raggedvl.data.split_rules import NON_WORDS_CHARS, SPLIT_KEYWORDS

    name = Path(path).name.lower()
    for split, keywords in SPLIT_KEYWORDS.items():
        if any(re.search(f"(^|[{NON_WORDS_CHARS}]){keyword}[{NON_WORDS_CHARS}]", name) for keyword in keywords):
            return str(split)
    return "train"


def folder_splits(folder: str | os.PathLike) -> dict[str, list[str]] | None:
    """Split name -> files of a local folder as ``datasets`` infers them from the file names
    (``DataFilesDict.from_patterns(get_data_patterns(folder))``, same splits and files in the
    same order): decided without importing ``datasets`` for the layouts
    ``split_rules.resolve_splits`` knows (a folder of files; hub shards in ``data/``), else by
    ``datasets``. None when ``datasets`` finds no data file or rejects a split name."""
    from raggedvl.data.split_rules import resolve_splits

    found = resolve_splits(folder)
    if found is not None:
        return found
    from datasets.data_files import DataFilesDict, get_data_patterns

    resolved = str(Path(folder).resolve())
    try:
        found = DataFilesDict.from_patterns(get_data_patterns(resolved), base_path=resolved)
    except (FileNotFoundError, ValueError):
        return None
    return {str(name): list(files) for name, files in found.items()}  # NamedSplit -> str


@dataclass(frozen=True)
class ParquetSplit:
    """One split of a local parquet dataset: its ``files`` (in ``datasets``' order), the folder
    relative image paths refer to (``base_dir``), its ``columns``, ``num_rows`` over all files, and
    ``where`` (how messages name it, e.g. ``"pairs.parquet split 'train'"``)."""

    files: tuple[Path, ...]
    base_dir: Path
    columns: tuple[str, ...]
    file_rows: tuple[int, ...]  # rows per file
    where: str

    @property
    def num_rows(self) -> int:
        return sum(self.file_rows)

    def file_of(self, row: int) -> Path:
        """The file that holds split row ``row``."""
        end = 0
        for file, rows in zip(self.files, self.file_rows):
            end += rows
            if row < end:
                return file
        raise IndexError(f"row {row} is beyond the {self.num_rows} rows of {self.where}")


class UnreadableParquet(ValueError):
    """A parquet file that pyarrow cannot read (cut short, damaged pages, not parquet); the
    message names the file and the fix."""


@contextlib.contextmanager
def reading_parquet(file: str | os.PathLike):
    """Turns pyarrow's errors while reading ``file`` (``ArrowException``, or an ``OSError``
    without an errno: "Parquet magic bytes not found", "Corrupt snappy compressed data") into
    ``UnreadableParquet`` naming the file; errors of the disk itself pass through."""
    import pyarrow as pa

    try:
        yield
    except UnreadableParquet:
        raise
    except (pa.ArrowException, OSError) as exc:
        if isinstance(exc, OSError) and not isinstance(exc, pa.ArrowException) and exc.errno is not None:
            raise
        raise UnreadableParquet(f"{file}: cannot read this parquet file ({' '.join(str(exc).split())}); re-write "
                                "or remove it (pyarrow.parquet.read_table must read it)") from exc


def _metadata(file: Path):
    import pyarrow.parquet as pq

    with reading_parquet(file):
        return pq.ParquetFile(file).metadata


def parquet_split(name_or_path: str | os.PathLike, split: str) -> ParquetSplit | None:
    """The split ``split`` of a local ``.parquet`` file (its one split, named by
    :func:`file_split`; ``split`` aliases as in ``pick_split``) or of a folder of parquet files; None for
    anything else (an rdocs manifest, an image folder, a folder with a dataset card, a hub id),
    which only the full loader reads, and a BEIR layout (:func:`is_beir_layout`). Raises ``ValueError`` naming the splits present when the
    split is missing, and naming the file and its columns when a file holds a column name twice
    or other columns than the split's first file (``datasets`` could not read such a split either)."""

    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix == ".parquet":
        files, base, splits = [path], path.parent, {file_split(path): [path]}
    elif (path.is_dir() and not (path / "manifest.jsonl").exists() and not (path / "README.md").exists()
          and not is_beir_layout(path)):
        found = folder_splits(path)
        if found is None:
            return None
        splits = {name: [Path(f) for f in files] for name, files in found.items()}
        base = path
    else:
        return None
    files = splits[pick_split(list(splits), split, str(name_or_path))]
    if not files or any(f.suffix != ".parquet" for f in files):
        return None
    metadata = [_metadata(f) for f in files]
    columns = [m.schema.to_arrow_schema().names for m in metadata]
    for f, names in zip(files, columns):
        if len(set(names)) < len(names):
            twice = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"{f} holds columns named {twice} more than once (columns: {names}); rename or drop the "
                             "duplicates")
        if set(names) != set(columns[0]):
            raise ValueError(f"{f} has the columns {names}, {files[0]} has {columns[0]}: every parquet file of a split "
                             "must hold the same columns; re-write or remove this file")
    return ParquetSplit(tuple(files), base, tuple(columns[0]), tuple(m.num_rows for m in metadata),
                        f"{name_or_path} split {split!r}")


def beir_part(root: Path, stem: str) -> Path | None:
    """The first entry of folder ``root`` named ``stem*`` that is a folder or a ``.parquet`` file
    (a BEIR layout's ``corpus`` / ``queries`` / ``qrels`` part), else None."""
    hits = sorted(p for p in root.iterdir() if p.name.startswith(stem) and (p.is_dir() or p.suffix == ".parquet"))
    return hits[0] if hits else None


def is_beir_layout(name_or_path: str | os.PathLike) -> bool:
    """True for a local folder holding ``corpus*``, ``queries*`` and ``qrels*`` parts."""
    root = Path(name_or_path).expanduser()
    return root.is_dir() and all(beir_part(root, stem) is not None for stem in ("corpus", "queries", "qrels"))


# what other datasets name the query and image columns: "did you mean" them when no name is close
COLUMN_SYNONYMS = {"query": ("question", "text"), "image": ("page", "img", "picture")}


def check_columns(available: Sequence[str], where: str, columns: Columns) -> None:
    """Raises :class:`~raggedvl.data.columns.ColumnError` naming the missing column, the
    columns present and the closest of them ("did you mean": :func:`raggedvl.suggest.closest`,
    else a present column of :data:`COLUMN_SYNONYMS`)."""
    available = list(available)
    nouns = {"query": "column", "image": "column", "id": "id column", "negatives": "hard-negatives column",
             "source": "source column"}
    for role in ROLES:
        column = getattr(columns, role)
        if column is None or column in available:
            continue
        close = closest(column, available) or next(
            (c for c in available if c.casefold() in COLUMN_SYNONYMS.get(role, ())), None)
        raise ColumnError(f"{where} has no {nouns[role]} {column!r} (columns: {available})"
                          + (f"; did you mean {close!r}?" if close else ""), role)


TEXT_SAMPLE_ROWS = 5  # rows whose strings decide whether an image column holds text


def is_text_type(kind) -> bool:
    """Whether the Arrow type ``kind`` holds strings, or lists of strings: a column of image
    paths, or of text (:func:`check_not_text` tells them apart)."""
    import pyarrow as pa

    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
        kind = kind.value_type
    return pa.types.is_string(kind) or pa.types.is_large_string(kind)


@functools.cache
def _image_extensions() -> frozenset[str]:
    from PIL import Image

    return frozenset(ext.lower() for ext in Image.registered_extensions())


def _names_an_image(value: str, base_dir: Path | None) -> bool:
    """Whether string ``value`` reads as an image path: an image extension (``.png``, ...), or
    an existing file (relative to ``base_dir``, else as given)."""
    if Path(value).suffix.lower() in _image_extensions():
        return True
    try:
        return (Path(base_dir) / value if base_dir is not None else Path(value)).is_file()
    except (OSError, ValueError):  # a name too long, a NUL character: text
        return False


def check_not_text(values: Sequence[Any], *, role: str, columns: Columns, where: str, available: Sequence[str],
                   base_dir: str | os.PathLike | None) -> None:
    """Raises :class:`~raggedvl.data.columns.ColumnError` when the image column of ``role``
    ("image" or "negatives") holds text, not images or image paths: it is the query column, or
    none of the strings in ``values`` (its first rows' cells, each one value or a list; see
    ``TEXT_SAMPLE_ROWS``) has an image extension or is an existing file (relative to
    ``base_dir``). The message quotes the first string and names the columns present. A column
    of image paths passes even when some of its files are missing (a missing file is a
    ``BadImageError`` naming its row); values that are not strings (bytes, the ``datasets``
    Image struct) always pass."""
    column = getattr(columns, role)
    strings = [(row, v) for row, cell in enumerate(values)
               for v in (cell if isinstance(cell, list) else [cell]) if isinstance(v, str)]
    if not strings:
        return
    is_query = column == columns.query
    if not is_query and any(_names_an_image(v, None if base_dir is None else Path(base_dir)) for _, v in strings):
        return
    row, value = strings[0]
    shown = value if len(value) <= 60 else value[:57] + "..."
    why = ("it is the query column" if is_query
           else f"no file of that name, and none of the first {len(strings)} values has an image extension "
                "such as .png")
    raise ColumnError(f"the {'hard-negatives' if role == 'negatives' else role} column {column!r} holds text, not "
                      f"images: row {row}'s value {shown!r} is not an image file ({why}; {where}; "
                      f"columns: {list(available)})", role)


def check_image_column(split: ParquetSplit, role: str, columns: Columns) -> None:
    """:func:`check_not_text` on the first ``TEXT_SAMPLE_ROWS`` rows of ``split``'s column of
    ``role`` when its Arrow type holds strings (only then are values read: an image column's
    bytes are not). Raises ``ColumnError`` as that does."""
    import pyarrow.parquet as pq

    column = getattr(columns, role)
    with reading_parquet(split.files[0]):
        file = pq.ParquetFile(split.files[0])
        if not is_text_type(file.schema_arrow.field(column).type):
            return
        batch = next(file.iter_batches(batch_size=TEXT_SAMPLE_ROWS, columns=[column]), None)
    values = [] if batch is None else batch.column(0).to_pylist()[:TEXT_SAMPLE_ROWS]
    check_not_text(values, role=role, columns=columns, where=split.where, available=split.columns,
                   base_dir=split.base_dir)


def read_column(split: ParquetSplit, column: str) -> list[Any]:
    """One column of the split as Python values, all files concatenated (for the small text
    columns: queries, ids; every file holds each column once: :func:`parquet_split`). Reads
    through ``pq.ParquetFile``: ``pq.read_table`` would import ``pyarrow.dataset`` and with it
    pandas (~50 MiB resident in the training process). Raises ``UnreadableParquet`` for a file
    pyarrow cannot read."""
    import pyarrow.parquet as pq

    values: list[Any] = []
    for f in split.files:
        with reading_parquet(f), pq.ParquetFile(f) as parquet:
            data = parquet.read(columns=[column]).column(column)
            try:
                values += data.to_pylist()
            except UnicodeDecodeError as exc:
                raise ValueError(_not_utf8(f, column, data, len(values), exc)) from None
    return values


def _not_utf8(file: Any, column: str, data: Any, first_row: int, exc: UnicodeDecodeError) -> str:
    """The one-line error for a text column holding bytes that are not UTF-8: file, column, row."""
    import pyarrow as pa

    raw = data.cast(pa.binary()).to_pylist() if hasattr(data, "cast") else []
    row = next((i for i, v in enumerate(raw) if v is not None and not _decodes(v)), None)
    where = f"row {first_row + row}" if row is not None else "a row"
    value = raw[row] if row is not None else b""
    return (f"{file}: column {column!r} {where} is not valid UTF-8 text ({exc.reason}: byte 0x{exc.object[exc.start]:02x} "
            f"at position {exc.start} of {value[:40]!r}); write the column as UTF-8 text (re-encode from its "
            "original encoding, e.g. latin-1)")


def _decodes(value: bytes) -> bool:
    try:
        value.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


@dataclass
class ImageSizes:
    """``sizes`` [N, 2] int64 (width, height), -1 where the header could not be read (a list
    column: [N, K, 2]); ``errors``: row -> reason (the message with the row's label left out;
    a list column: its first unreadable image's); ``counts``: a list column's images per row
    [N] int64 (None for an image column)."""

    sizes: np.ndarray
    errors: dict[int, str]
    counts: np.ndarray | None = None

    def size(self, row: int) -> tuple[int, int] | None:
        width, height = (int(v) for v in self.sizes[row])
        return None if width < 0 else (width, height)

    def message(self, row: int, label: str) -> str:
        """The ``BadImageError`` text of an unreadable row, naming it as ``label``."""
        return self.errors[row].replace(_LABEL, label, 1)


def _image_source(value: Any, base_dir: Path) -> Any:
    """What ``raggedvl.images.read_size`` reads for one parquet value: a ``{"bytes", "path"}``
    struct (``datasets``' Image feature), bytes, or a path relative to ``base_dir``."""
    if isinstance(value, str):
        return str(base_dir / value)
    if isinstance(value, dict) and value.get("bytes") is None and value.get("path"):
        return {"bytes": None, "path": str(base_dir / value["path"])}
    return value


def resolved_image_column(values: Any, base_dir: Path) -> Any:
    """The image column ``values`` (a ``pyarrow`` array of one image or a list of images per
    row) with each path, a string's or a ``{"bytes": None, "path"}`` struct's, joined to
    ``base_dir`` (the folder the paths are relative to): rows that read the same files wherever
    the table is written (an absolute ``base_dir``: absolute paths). Bytes are kept as they are."""
    import pyarrow as pa

    kind = values.type
    several = pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)
    item = kind.value_type if several else kind
    if pa.types.is_binary(item) or pa.types.is_large_binary(item):  # no paths
        return values
    rows = [[_image_source(v, base_dir) for v in row] if several and row is not None else _image_source(row, base_dir)
            for row in values.to_pylist()]
    return pa.array(rows, type=kind)


def _read_one(value: Any, base_dir: Path, name: str) -> tuple[tuple[int, int], str | None]:
    """(size, None) of one image value, or ((-1, -1), reason) when its header cannot be read."""
    from raggedvl.images import BadImageError, read_size

    source = _image_source(value, base_dir)
    try:
        if source is None:
            raise BadImageError(f"{name} has no image (the value is null); fill it in or remove the row")
        return read_size(source, name=name), None
    except (BadImageError, TypeError) as exc:
        return (-1, -1), str(exc) if str(exc).startswith(_LABEL) else f"{name}: {exc}"


def _scan_part(task: tuple[str, int, str, str, str | None]) -> tuple[list[Any], dict[int, str]]:
    """Sizes of one row group (runs in a worker process): per row a (width, height), or with
    ``item`` (a list column) the list of its images' sizes."""
    import pyarrow.parquet as pq

    file, group, column, base_dir, item = task
    with reading_parquet(file):
        values = pq.ParquetFile(file).read_row_group(group, columns=[column]).column(column).to_pylist()
    sizes, errors = [], {}
    for i, value in enumerate(values):
        if item is None:
            size, reason = _read_one(value, Path(base_dir), _LABEL)
        else:  # one image or a list of them; a null cell holds none (the caller checks the counts)
            cell = [] if value is None else value if isinstance(value, list) else [value]
            read = [_read_one(v, Path(base_dir), f"{_LABEL}, {item} {j}") for j, v in enumerate(cell)]
            size = [r[0] for r in read]
            reason = next((r[1] for r in read if r[1] is not None), None)
        sizes.append(size)
        if reason is not None:
            errors[i] = reason
    return sizes, errors


def files_key(files: Sequence[str | os.PathLike], *parts: Any) -> str:
    """A cache key (24 hex digits) of ``parts`` and each file's resolved path, byte size and
    modification time: a changed file gives a new key (the size cache here, the Arrow cache)."""
    stamped = list(parts)
    for f in map(Path, files):
        stat = f.stat()
        stamped.append([str(f.resolve()), stat.st_size, stat.st_mtime_ns])
    return hashlib.sha256(json.dumps(stamped).encode()).hexdigest()[:24]


def _fingerprint(split: ParquetSplit, column: str, item: str | None = None) -> str:
    return files_key(split.files, SCAN_VERSION, column, item)


def _cache_paths(split: ParquetSplit, column: str, item: str | None = None) -> list[Path]:
    """Where the sizes of ``split`` are cached: beside the data first, then the cache root."""
    from raggedvl.data.cache import cache_root

    name = f"sizes-{_fingerprint(split, column, item)}.npz"
    return [split.files[0].parent / ".raggedvl" / name, cache_root() / "sizes" / name]


def cached_image_sizes(split: ParquetSplit, column: str, *, item: str | None = None) -> ImageSizes | None:
    """The cached sizes of ``split``'s ``column`` (``item``: as for :func:`image_sizes`), or None
    when no valid cache entry exists. Only reads."""
    for path in _cache_paths(split, column, item):
        try:
            with np.load(path) as data:
                sizes = data["sizes"]
                errors = {int(k): v for k, v in json.loads(str(data["errors"])).items()}
                counts = data["counts"] if "counts" in data.files else None
        except (OSError, KeyError, ValueError):
            continue
        if item is None:
            valid = sizes.shape == (split.num_rows, 2)
        else:
            valid = (sizes.ndim == 3 and sizes.shape[0] == split.num_rows and sizes.shape[2] == 2
                     and counts is not None and counts.shape == (split.num_rows,))
        if valid:
            return ImageSizes(sizes, errors, counts)
    return None


def _store(split: ParquetSplit, column: str, result: ImageSizes, item: str | None = None) -> None:
    """Write the cache entry atomically: a temporary file, then ``os.replace``."""
    for path in _cache_paths(split, column, item):
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            arrays = {"sizes": result.sizes, "errors": np.array(json.dumps({str(k): v for k, v in result.errors.items()}))}
            if result.counts is not None:
                arrays["counts"] = result.counts
            with open(tmp, "wb") as f:
                np.savez(f, **arrays)
            os.replace(tmp, path)
            return
        except OSError:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:  # e.g. its folder cannot exist
                pass
            continue


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def image_sizes(split: ParquetSplit, column: str, *, workers: int | None = None,
                item: str | None = None) -> ImageSizes:
    """Every row's image size from its header (module docstring), from the cache when it holds
    this split's files unchanged, else read (``workers`` processes, default one per CPU; one
    row group at a time, so memory holds a few row groups' bytes, not the dataset's) and
    cached (written here only, atomically). ``item`` (e.g. ``"hard negative"``): the column
    holds one image or a list of images per row, each named ``"<row>, <item> <j>"`` in
    messages (``j`` from 0); sizes [N, K, 2] and ``counts``. Raises nothing for unreadable
    images: they are in ``ImageSizes.errors``."""

    cached = cached_image_sizes(split, column, item=item)
    if cached is not None:
        return cached
    tasks = [(str(f), g, column, str(split.base_dir), item) for f in split.files
             for g in range(_metadata(f).num_row_groups)]
    workers = min(workers or _cpus(), len(tasks))
    if workers > 1 and split.num_rows >= PARALLEL_ROWS:
        with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
            parts = list(pool.map(_scan_part, tasks))
    else:
        parts = [_scan_part(t) for t in tasks]
    sizes, errors, offset = [], {}, 0
    for part_sizes, part_errors in parts:
        errors.update({offset + i: reason for i, reason in part_errors.items()})
        sizes.extend(part_sizes)
        offset += len(part_sizes)
    if item is None:
        result = ImageSizes(np.asarray(sizes, dtype=np.int64).reshape(-1, 2), errors)
    else:
        counts = np.asarray([len(row) for row in sizes], dtype=np.int64)
        grid = np.full((len(sizes), int(counts.max(initial=0)), 2), -1, dtype=np.int64)
        for row, row_sizes in enumerate(sizes):
            if row_sizes:
                grid[row, :len(row_sizes)] = row_sizes
        result = ImageSizes(grid, errors, counts)
    _store(split, column, result, item)
    return result

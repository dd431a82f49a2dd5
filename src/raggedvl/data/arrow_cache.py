"""A local parquet split as one memory-mapped Arrow table, read with pyarrow alone.

Training processes read their pairs from local parquet files through this module instead of
``datasets.load_dataset``: importing ``datasets`` (and the pandas it imports) costs each process
~110 MiB of memory and ~0.8 s, and a training process needs none of it for local files.
``datasets`` still reads everything else (hub ids, image folders, BEIR layouts).

The split's files (``raggedvl.data.scan.ParquetSplit``, in ``datasets``' order) are converted
once into an Arrow IPC file, ``<cache root>/arrow/<key>.arrow``, the key a hash of each file's
resolved path, byte size and modification time and of ``ARROW_VERSION``, so a changed file is
converted again. Parquet is read a batch of ``BATCH_ROWS`` rows at a time, without
pre-buffering column chunks, so converting holds about a batch's bytes, not a file's (measured:
a 300 MB file of 1 MB images in one row group peaked at ~1.2 GB with 256-row batches, against
1.9 GB through ``datasets``). The cache grows by one copy of a split per changed file and is never
pruned: delete ``<cache root>/arrow`` to reclaim it. The first
process converts (under a file lock; a temporary file and ``os.replace``, so no process ever
maps a partial file); every process then maps the file read-only: rows are read on access,
from the page cache, shared by all the processes of a machine, as ``datasets``' own Arrow cache
is.
"""

from __future__ import annotations

import os
from pathlib import Path

from raggedvl.data.scan import files_key, reading_parquet

ARROW_VERSION = 1  # in the cache key
BATCH_ROWS = 64  # a batch of 1 MB page images: ~64 MB held while converting


class MappedTable:
    """A ``pyarrow.Table`` memory-mapped from an Arrow IPC file at ``path`` (``.table``, opened
    on first use). Pickles as its path, so a process that receives it (a spawned data worker)
    maps the same file instead of copying its rows."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = str(path)
        self._table = None

    @property
    def table(self):
        if self._table is None:
            import pyarrow as pa

            with pa.memory_map(self.path, "r") as source:
                self._table = pa.ipc.open_file(source).read_all()  # zero-copy: buffers point into the map
        return self._table

    def __getstate__(self) -> dict:
        return {"path": self.path}

    def __setstate__(self, state: dict) -> None:
        self.path, self._table = state["path"], None


def _complete(path: Path) -> bool:
    """Whether ``path`` is an Arrow IPC file whose footer reads (a file cut short by a crash or
    a full disk, or overwritten by hand, is converted again rather than failing every run with
    pyarrow's "Not an Arrow file")."""
    import pyarrow as pa

    if not path.is_file():
        return False
    try:
        with pa.memory_map(str(path), "r") as source:
            pa.ipc.open_file(source)
    except (pa.ArrowInvalid, OSError):
        return False
    return True


def _schema(files):
    """The files' common Arrow schema (the first file's, its metadata kept), or None when
    another file's columns or types differ (``datasets`` then reads the split: it unifies)."""
    import pyarrow.parquet as pq

    schemas = []
    for f in files:
        with reading_parquet(f):
            schemas.append(pq.read_schema(f))
    first = schemas[0]
    return first if all(s.equals(first, check_metadata=False) for s in schemas[1:]) else None


def _convert(files, schema, path: Path) -> None:
    """Write ``files``' rows into the Arrow IPC file ``path`` (a temporary file, then
    ``os.replace``). Raises ``UnreadableParquet`` naming the file pyarrow cannot read, and
    ``OSError`` when the cache cannot be written."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
            for f in files:
                with reading_parquet(f):
                    parquet = pq.ParquetFile(f, pre_buffer=False, buffer_size=1 << 20)
                    for batch in parquet.iter_batches(batch_size=BATCH_ROWS, use_threads=False):
                        writer.write_batch(batch.replace_schema_metadata(schema.metadata))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def mapped_split(files, cache_dir: str | os.PathLike | None = None) -> MappedTable | None:
    """The rows of parquet ``files`` (in that order) as one memory-mapped table, converting
    them into the Arrow cache first when needed (module docstring). Returns None when the files'
    schemas differ, or when the cache folder cannot be written (the caller reads the split
    with ``datasets``). Raises ``UnreadableParquet`` (a ``ValueError``) naming a file pyarrow
    cannot read: cut short, damaged pages, not parquet."""
    from filelock import FileLock

    from raggedvl.data.cache import cache_root

    files = [Path(f) for f in files]
    folder = cache_root(cache_dir) / "arrow"
    path = folder / f"{files_key(files, ARROW_VERSION)}.arrow"
    if _complete(path):
        return MappedTable(path)
    schema = _schema(files)
    if schema is None:
        return None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with FileLock(str(path) + ".lock"):
            if not _complete(path):
                _convert(files, schema, path)
    except OSError:
        return None
    return MappedTable(path)

"""Retrieval datasets: (query, document image) pairs from an rdocs manifest or HF ``datasets``.

Items are dicts ``{"query": str, "image": PIL.Image (RGB, decoded on access), "id": str, ...}``
plus metadata (rdocs: split, pdf, page, pages, view, dpi, width, height, source). Query i's
relevant document is item i's image. The image column may hold a list of images per row (at
least one): the query's several positives. An item then holds one of them as ``"image"``
(``item(i, positive=j)``; ``dataset[i]`` is positive 0, :mod:`raggedvl.data.positives` draws one
per epoch for training) and the keys of the others as ``"relevant_keys"``, which the losses mask
from the query's candidates. With a hard-negatives column (``Columns(negatives=...)``) an item also
holds ``"negatives"``: a list of the row's own PIL images, any number per row (0 for an empty or
null cell; the losses take each query's count), decoded on access like the image. Every item
carries ``"doc_key"`` (and with negatives ``"negative_keys"``): the document key of its page
(:func:`raggedvl.data.keys.bytes_key` of the stored bytes), which the losses use to keep a page
from being a negative of a query it answers.

Bad input policy:
- a missing ``query`` / ``image`` column (or manifest key): ValueError at construction, naming
  the columns present and the ``Columns(query=...)`` / ``Columns(image=...)`` fix;
- an empty or non-string query: ValueError at construction naming the row and id, or with
  ``on_empty_query="skip"`` the row is left out and listed in ``dataset.skipped_rows``
  (``{"row", "id", "reason"}``), or with ``on_empty_query="keep"`` the row stays with query
  None: a corpus-only document (ViDoRe v1 test sets hold such distractor pages; evaluation
  keeps them in the corpus, see ``raggedvl.evaluation.benchmark``; the training collator
  rejects them);
- an unreadable, corrupt or oversized image (see ``raggedvl.images``): with
  ``on_bad_image="error"`` a ``BadImageError`` naming the row and id when the item is read;
  with ``"skip"`` the item comes back with ``image=None`` and ``image_error`` set (the short
  cause, ``BadImageError.reason``, prefixed ``hard negative J:`` for a negative), and
  ``RetrievalCollator`` drops it and lists it under ``"skipped"`` in its output (counted in the
  run summary, never silent). A bad hard negative does the same to its whole row;
- a hard-negatives or image column that is missing or holds something other than images
  (paths, bytes, the datasets ``Image`` feature), or a row whose list of positives is empty:
  ``ValueError`` at construction naming the row and the fix.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from PIL import Image

from raggedvl.data.arrow_cache import MappedTable, mapped_split
from raggedvl.data.scan import (
    TEXT_SAMPLE_ROWS,
    check_columns,
    check_not_text,
    file_split,
    ParquetSplit,
    is_text_type,
    pick_split,
)
from raggedvl.data.columns import Columns
from raggedvl.data.keys import bytes_key, image_key
from raggedvl.data.source import DataSource
from raggedvl.images import (BadImageError, BadImagePolicy, check_bad_image_policy, load_image, read_size,
                             unreadable_image)


def _limit_order(ids: list[str], limit: int | None) -> list[int]:
    """Row positions to keep: all, or the ``limit`` rows whose id hashes lowest (a stable
    sample: smaller limits give subsets of larger ones), in their original order."""
    if limit is None:
        return list(range(len(ids)))
    if not isinstance(limit, int) or limit < 1:
        raise ValueError(f"limit must be a positive integer or None, got {limit!r}")
    ranked = sorted(range(len(ids)), key=lambda i: (hashlib.sha256(ids[i].encode()).digest(), i))
    return sorted(ranked[:limit])


EMPTY_QUERY_POLICIES = ("error", "skip", "keep")


def _bad_query_rows(queries: list[Any], ids: list[str], where: str, policy: str) -> list[dict[str, Any]]:
    """Rows whose query is empty or not a string: raise (policy "error"), list them ("skip"), or
    accept them as corpus-only rows ("keep": returns no row; a non-string, non-None query still
    raises)."""
    bad = []
    for row, (query, ident) in enumerate(zip(queries, ids)):
        if isinstance(query, (bytes, bytearray)):  # a binary column: skipping would drop every row
            raise ValueError(
                f"{where}: row {row} (id {ident!r}) has a query of bytes, not text ({bytes(query[:40])!r}): the query "
                "column is binary; write it as a string column (decode the bytes, e.g. as UTF-8)")
        if not isinstance(query, str) or not query.strip():
            if policy == "keep" and (query is None or isinstance(query, str)):
                continue
            if policy != "skip":
                raise ValueError(
                    f"{where}: row {row} (id {ident!r}) has an empty or non-string query {query!r}; "
                    "remove the row, fill in its query, or pass --on-empty-query skip (key on_empty_query: "
                    "the row is left out and counted)"
                )
            bad.append({"row": row, "id": ident, "reason": f"empty or non-string query {query!r}"})
    return bad


def source_values(values: Sequence[Any], rows: Sequence[int], ids: Sequence[str], column: str,
                  where: str) -> list[str]:
    """Each of ``rows``' value of the source column ``column`` (``values``: the whole column), as
    text (``raggedvl train --source-column``: rows with equal values form one source). Raises
    ``ValueError`` naming the first row whose value is missing (null)."""
    out = []
    for row, ident in zip(rows, ids):
        value = values[row]
        if value is None:
            raise ValueError(f"{where}: row {row} (id {ident!r}) has no value in the source column {column!r}; fill "
                             "it in, leave the row out, or pass --source-column none")
        out.append(str(value))
    return out


def kept_rows(queries: list[Any], ids: list[str], where: str, on_empty_query: str,
              limit: int | None = None) -> tuple[list[int], list[dict[str, Any]]]:
    """(rows kept, rows skipped): the rows a loader keeps of a table with these ``queries`` and
    ``ids`` under ``on_empty_query`` (see ``_bad_query_rows``; "error" raises), then the stable
    ``limit`` sample of them (``_limit_order``)."""
    skipped = _bad_query_rows(queries, ids, where, on_empty_query)
    bad_rows = {s["row"] for s in skipped}
    valid = [i for i in range(len(ids)) if i not in bad_rows]
    return [valid[j] for j in _limit_order([ids[i] for i in valid], limit)], skipped


class _SizesOrSources(Sequence):
    """Per row, its known (width, height), else its image source (whose header a size estimate
    reads): a view over two equally long sequences."""

    def __init__(self, sizes: Sequence[tuple[int, int] | None], sources: Sequence[Any]) -> None:
        self.sizes, self.sources = sizes, sources

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, index: int) -> Any:
        size = self.sizes[index]
        return self.sources[index] if size is None else size


class _ImageColumn(Sequence):
    """Lazy view of one image column of an Arrow table (rows read on access, so image bytes are
    never all held in memory; a memory-mapped table's rows stay in the page cache); string paths
    are resolved against ``base_dir``. Iteration (a size estimate's scan) reads ``ITER_ROWS`` rows
    per call, not one. Pickles with its table (a ``MappedTable`` pickles as its path)."""

    ITER_ROWS = 256

    def __init__(self, table, column: str, rows: list[int], base_dir: str | os.PathLike | None) -> None:
        self.table, self.column, self.rows, self.base_dir = table, column, rows, base_dir
        self._values = None

    @property
    def values(self):
        """The column (``pyarrow.ChunkedArray``)."""
        if self._values is None:
            self._values = _arrow(self.table).column(self.column)
        return self._values

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_values": None}

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> Any:
        return self._resolved(self.values[self.rows[index]].as_py())

    def __iter__(self):
        import pyarrow as pa

        for start in range(0, len(self.rows), self.ITER_ROWS):
            part = self.values.take(pa.array(self.rows[start:start + self.ITER_ROWS], type=pa.int64()))
            yield from map(self._resolved, part.to_pylist())

    def _resolved(self, value: Any) -> Any:
        if isinstance(value, str) and self.base_dir is not None:
            return str(Path(self.base_dir) / value)
        return value


def _arrow(table):
    """The ``pyarrow.Table`` of a ``MappedTable`` or of a table."""
    return table.table if isinstance(table, MappedTable) else table


def _arrow_of_hf(dataset):
    """A ``datasets.Dataset``'s rows as the user sees them, as a ``pyarrow.Table`` (a selected or
    shuffled view is flattened first), or ``dataset`` itself when it is already a table."""
    if isinstance(dataset, MappedTable) or not hasattr(dataset, "features"):
        return dataset
    if getattr(dataset, "_indices", None) is not None:
        dataset = dataset.flatten_indices()
    return dataset.data.table


def list_counts(dataset, column: str, where: str, what: str) -> tuple[list[int], bool]:
    """(each table row's number of images in ``column``, whether the column holds lists), read
    from the Arrow column's list lengths (no image bytes are copied); a null cell holds 0 and a
    one-image column 1 per row. ``what`` names the column in errors (:func:`check_images_type`)."""
    import pyarrow.compute as pc

    chunked = _arrow(dataset).column(column)
    is_list = check_images_type(chunked.type, column, where, what)
    if is_list:
        lengths = pc.list_value_length(chunked).to_numpy(zero_copy_only=False)
    else:
        lengths = chunked.is_valid().to_numpy(zero_copy_only=False).astype(int)
    nulls = chunked.is_null().to_numpy(zero_copy_only=False)
    counts = [0 if nulls[r] or lengths[r] != lengths[r] else int(lengths[r]) for r in range(len(lengths))]  # null: NaN
    return counts, is_list


def is_list_type(kind) -> bool:
    """Whether the Arrow type ``kind`` is a list (of images: several per row)."""
    import pyarrow as pa

    return pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)


def check_images_type(kind, column: str, where: str, what: str = "hard-negatives") -> bool:
    """Whether the Arrow type ``kind`` of an image column (``what``: "hard-negatives" or
    "image") is a list of images per row (else one image per row). Raises ``ValueError`` when
    its values are not images (paths, bytes or the datasets Image struct). Reads the schema
    only: the launcher calls it before torch."""
    import pyarrow as pa

    is_list = is_list_type(kind)
    item = kind.value_type if is_list else kind
    image_like = (pa.types.is_string(item) or pa.types.is_large_string(item) or pa.types.is_binary(item)
                  or pa.types.is_large_binary(item) or (pa.types.is_struct(item) and item.get_field_index("bytes") >= 0))
    if not image_like:
        raise ValueError(f"{where}: {what} column {column!r} holds {item} values, not images; give each row "
                         "one image or a list of images (the datasets Image feature, file paths or encoded bytes)")
    return is_list


def check_positive_counts(counts: Sequence[int], rows: list[int], ids: list[str], column: str, where: str) -> None:
    """Raise ``ValueError`` naming the first of ``rows`` whose list of positives in ``column`` is
    empty (``counts``: per table row; ``ids``: of ``rows``, in order)."""
    for position, row in enumerate(rows):
        if counts[row] == 0:
            raise ValueError(f"{where}: row {row} (id {ids[position]!r}) has no image in its list of positives in "
                             f"column {column!r}; give every row at least one image there, or remove the row")


class _RowLists(Sequence):
    """Per row, the list of its undecoded image sources (hard negatives, or positives; a
    one-image cell is a list of one, a null cell an empty list), read lazily from a view of the
    column."""

    def __init__(self, column: "_ImageColumn", base_dir: str | os.PathLike | None) -> None:
        self.column, self.base_dir = column, base_dir  # the column view joins no paths itself

    def __len__(self) -> int:
        return len(self.column)

    def __getitem__(self, index: int) -> list[Any]:
        return self._listed(self.column[index])

    def __iter__(self):
        return map(self._listed, iter(self.column))

    def _listed(self, value: Any) -> list[Any]:
        values = [] if value is None else list(value) if isinstance(value, (list, tuple)) else [value]
        if self.base_dir is not None:
            values = [str(Path(self.base_dir) / v) if isinstance(v, str) else v for v in values]
        return values


class _KnownOrSources(Sequence):
    """Per row, each hard negative's known (width, height), else its source (whose header a
    size estimate reads): ``sizes`` [rows] of lists, ``sources`` the rows' source lists."""

    def __init__(self, sizes: Sequence[list[tuple[int, int] | None]], sources: Sequence[list[Any]]) -> None:
        self.sizes, self.sources = sizes, sources

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, index: int) -> list[Any]:
        known = self.sizes[index]
        if known and all(size is not None for size in known):
            return list(known)  # every size known: no source is read
        sources = self.sources[index]
        return [source if size is None else size for size, source in zip(known, sources)] if known else sources


class _Firsts(Sequence):
    """Per row, the first of its list (its positive 0): lazy."""

    def __init__(self, lists: Sequence[list[Any]]) -> None:
        self.lists = lists

    def __len__(self) -> int:
        return len(self.lists)

    def __getitem__(self, index: int) -> Any:
        return self.lists[index][0]

    def __iter__(self):
        return (row[0] for row in self.lists)


class _Singletons(Sequence):
    """Per row, a list of its one value: a one-image column seen as lists of positives."""

    def __init__(self, values: Sequence[Any]) -> None:
        self.values = values

    def __len__(self) -> int:
        return len(self.values)

    def __getitem__(self, index: int) -> list[Any]:
        return [self.values[index]]


class _Chosen(Sequence):
    """Per row, ``choose(lists[row])``: lazy."""

    def __init__(self, lists: Sequence[list[Any]], choose) -> None:
        self.lists, self.choose = lists, choose

    def __len__(self) -> int:
        return len(self.lists)

    def __getitem__(self, index: int) -> Any:
        return self.choose(self.lists[index])


class _Picked(Sequence):
    """Lazy view of ``values`` at ``positions`` (nothing is read until indexed)."""

    def __init__(self, values: Sequence[Any], positions: list[int]) -> None:
        self.values, self.positions = values, positions

    def __len__(self) -> int:
        return len(self.positions)

    def __getitem__(self, index: int) -> Any:
        return self.values[self.positions[index]]


class _Kept(Sequence):
    """Per row, the items of ``values``' list at that row's ``kept`` positions (lazy)."""

    def __init__(self, values: Sequence[list[Any]], kept: list[list[int]]) -> None:
        self.values, self.kept = values, kept

    def __len__(self) -> int:
        return len(self.kept)

    def __getitem__(self, index: int) -> list[Any]:
        row = self.values[index]
        return [row[j] for j in self.kept[index]]


class _WithNegatives(Sequence):
    """Per row, ``[image, *negatives]``: what a size estimate of the whole row reads."""

    def __init__(self, images: Sequence[Any], negatives: Sequence[list[Any]]) -> None:
        self.images, self.negatives = images, negatives

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> list[Any]:
        return [self.images[index], *self.negatives[index]]

    def __iter__(self):
        return ([image, *negatives] for image, negatives in zip(self.images, self.negatives))


class RetrievalDataset(Sequence):
    """A split of (query, document image) pairs with lazy image decoding.

    Build with ``from_manifest`` (rdocs directory) or ``from_hf`` (a ``datasets.Dataset``), or
    through ``load_retrieval_dataset``. ``split`` names the split held.

    ``image_sources``: per row, its (first) positive's undecoded image; ``positive_sources``
    (optional): per row, the list of all its positives (``image_sources[i]`` being
    ``positive_sources[i][0]``), with ``positive_inputs`` their known (width, height) or
    sources. ``negative_sources``: per row, the list of its hard negatives (any length), with
    ``negative_inputs`` likewise.
    """

    def __init__(
        self,
        records: list[dict[str, Any]],
        image_sources: list[Any],
        split: str,
        *,
        sizes: list[tuple[int, int] | None] | None = None,
        on_bad_image: BadImagePolicy = "error",
        max_source_pixels: int = 64_000_000,
        where: str = "dataset",
        on_empty_query: str = "error",
        negative_sources: Sequence[list[Any]] | None = None,
        negative_counts: Sequence[int] | None = None,
        negative_inputs: Sequence[list[Any]] | None = None,
        positive_sources: Sequence[list[Any]] | None = None,
        positive_counts: Sequence[int] | None = None,
        positive_inputs: Sequence[list[Any]] | None = None,
    ) -> None:
        check_bad_image_policy(on_bad_image)
        if len(records) != len(image_sources):
            raise ValueError(f"{len(records)} records but {len(image_sources)} image sources")
        if negative_sources is not None and len(negative_sources) != len(records):
            raise ValueError(f"{len(records)} records but {len(negative_sources)} hard-negative lists")
        _bad_query_rows([r.get("query") for r in records], [r.get("id", "") for r in records], where, on_empty_query)
        self.skipped_rows: list[dict[str, Any]] = []  # rows left out by on_empty_query="skip"
        self.records = records
        self.image_sources = image_sources
        self.split = split
        self.on_bad_image = on_bad_image
        self.max_source_pixels = max_source_pixels
        self.where = where
        self.on_empty_query = on_empty_query
        self.part_sizes = [len(records)]  # rows of each dataset concat_datasets joined (one entry otherwise)
        self.negative_sources = negative_sources  # per row, its undecoded images (None: no hard negatives)
        # per row, its number of hard negatives (None: read from negative_sources when asked)
        self._negative_counts = None if negative_sources is None else negative_counts
        # per row, each hard negative's known (width, height) (the size cache) or its source
        self.negative_inputs = negative_inputs if negative_sources is not None else None
        self._positives = positive_sources  # per row, all its positives (None: one per row, image_sources)
        self._positive_counts = positive_counts if positive_sources is not None else None
        self._positive_inputs = positive_inputs if positive_sources is not None else None
        self._sizes = sizes  # from the manifest or the size cache; a None entry: read the header
        self._read_sizes: list[tuple[int, int] | None] | None = None  # from the headers, cached

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_manifest(
        cls, directory: str | os.PathLike, split: str | None = "train", *, limit: int | None = None,
        on_empty_query: str = "error", source_column: str | None = None, **kwargs,
    ) -> "RetrievalDataset":
        """Rows of ``<directory>/manifest.jsonl`` whose ``split`` matches (None: all rows).
        ``source_column``: a manifest key whose value is each row's ``"source_value"``.

        Raises ValueError for a missing manifest, a row without ``query``/``image``/``id`` (or
        ``source_column``), or a split with no rows (naming the splits present).
        """
        root = Path(directory)
        manifest = root / "manifest.jsonl" if root.is_dir() else root
        if not manifest.is_file():
            raise ValueError(f"{manifest} not found; build the dataset with raggedvl.data.build_rdocs() first")
        rows = [json.loads(line) for line in manifest.read_text().splitlines() if line.strip()]
        for number, row in enumerate(rows):
            missing = [k for k in ("query", "image", "id") if k not in row]
            if missing:
                raise ValueError(f"{manifest}: row {number} lacks {missing} (keys present: {sorted(row)})")
        chosen = [r for r in rows if split is None or r.get("split") == split]
        if not chosen:
            raise ValueError(f"{manifest} has no rows in split {split!r}; splits present: {sorted({r.get('split') for r in rows})}")
        skipped = _bad_query_rows([r["query"] for r in chosen], [r["id"] for r in chosen], str(manifest), on_empty_query)
        bad_rows = {s["row"] for s in skipped}
        chosen = [r for i, r in enumerate(chosen) if i not in bad_rows]
        keep = _limit_order([r["id"] for r in chosen], limit)
        chosen = [chosen[i] for i in keep]
        sizes = [(r["width"], r["height"]) if "width" in r and "height" in r else None for r in chosen]
        sources = [manifest.parent / r["image"] for r in chosen]
        records = [{k: v for k, v in r.items() if k != "image"} for r in chosen]
        if source_column is not None:
            missing = next((r for r in chosen if r.get(source_column) is None), None)
            if missing is not None:
                raise ValueError(f"{manifest}: row {missing['id']!r} has no {source_column!r} (keys present: "
                                 f"{sorted(missing)}); pass --source-column naming a key every row has, or none")
            for record in records:
                record["source_value"] = str(record[source_column])
        dataset = cls(records, sources, split or "all", sizes=None if None in sizes else sizes, where=str(manifest),
                      on_empty_query=on_empty_query, **kwargs)
        dataset.skipped_rows = skipped
        return dataset

    @classmethod
    def from_hf(
        cls,
        dataset,
        split: str = "train",
        *,
        columns: Columns = Columns(),
        limit: int | None = None,
        base_dir: str | os.PathLike | None = None,
        on_empty_query: str = "error",
        sizes: Sequence[tuple[int, int] | None] | None = None,
        negative_sizes: Sequence[list[tuple[int, int] | None]] | None = None,
        ids: Sequence[str] | None = None,
        **kwargs,
    ) -> "RetrievalDataset":
        """Wrap a ``datasets.Dataset`` (or a ``pyarrow.Table``, or a ``MappedTable`` from
        ``raggedvl.data.arrow_cache``) with the ``columns`` (:class:`~raggedvl.data.columns.Columns`):
        a query column and an image column (the datasets ``Image`` feature, encoded bytes, or
        strings holding paths relative to ``base_dir``; or a list of them per row: the query's
        positives, at least one), optionally an id column and a hard-negatives column (one image
        or a list of any length per row).
        ``sizes``: each row's image (width, height) when known (``raggedvl.data.scan``'s cache;
        None: read the header when needed), so that a size estimate reads no image (an image
        column of lists: per row the list of its positives' sizes);
        ``negative_sizes``: likewise, per row the list of its hard negatives' sizes.
        Raises :class:`~raggedvl.data.columns.ColumnError` (a ``ValueError``) for a missing
        column and for an image or hard-negatives column that holds text, e.g. the queries
        (``raggedvl.data.scan.check_not_text``), and ``ValueError`` for values that are not
        images and for a row with an empty list of positives.

        Rows are read from the Arrow data, undecoded (an ``Image`` value is its
        ``{"bytes", "path"}`` storage), row by row on access, and decoded by this package's
        hardened loader. Ids come from ``columns.id``, else from ``ids`` (one per table row, e.g.
        the file paths :func:`load_retrieval_dataset` gives the rows of an image folder), else
        are ``"<split>-<row>"``. Raises ``ValueError`` for ``ids`` of another length than the table.
        """
        source = _arrow_of_hf(dataset)  # what the columns keep a reference to (a MappedTable pickles small)
        table = _arrow(source)
        available = list(table.column_names)
        where = kwargs.pop("where", None) or f"dataset split {split!r}"
        check_columns(available, where, columns)
        for role in ("image", "negatives"):
            column = getattr(columns, role)
            if column is not None and is_text_type(table.schema.field(column).type):  # paths, or text?
                check_not_text(table.column(column).slice(0, TEXT_SAMPLE_ROWS).to_pylist(), role=role,
                               columns=columns, where=where, available=available, base_dir=base_dir)
        queries = table.column(columns.query).to_pylist() if columns.query else [None] * table.num_rows
        if columns.id is None and ids is not None and len(ids) != len(queries):
            raise ValueError(f"{where}: {len(ids)} ids for {len(queries)} rows; pass one id per row")
        ids = ([str(v) for v in table.column(columns.id).to_pylist()] if columns.id
               else list(ids) if ids is not None else [f"{split}-{i}" for i in range(len(queries))])
        keep, skipped = kept_rows(queries, ids, where, on_empty_query, limit)
        records = [{"query": queries[i], "id": ids[i], "row": i} for i in keep]
        if columns.source is not None:
            values = source_values(table.column(columns.source).to_pylist(), keep, [ids[i] for i in keep],
                                   columns.source, where)
            for record, value in zip(records, values):
                record["source_value"] = value
        kept_ids = [ids[i] for i in keep]
        several = is_list_type(table.schema.field(columns.image).type)
        images = _ImageColumn(source, columns.image, keep, None if several else base_dir)
        if several:  # a list of positives per row
            positive_counts, _ = list_counts(table, columns.image, where, "image")
            check_positive_counts(positive_counts, keep, kept_ids, columns.image, where)
            positives = _RowLists(images, base_dir)
            kwargs.update(positive_sources=positives, positive_counts=[positive_counts[i] for i in keep])
            if sizes is not None:
                kwargs["positive_inputs"] = _KnownOrSources([sizes[i] for i in keep], positives)
                sizes = [row[0] if row else None for row in sizes]
            images = _Firsts(positives)
        if columns.negatives is not None:
            counts, _ = list_counts(table, columns.negatives, where, "hard-negatives")
            negatives = _RowLists(_ImageColumn(source, columns.negatives, keep, None), base_dir)
            kwargs.update(negative_sources=negatives, negative_counts=[counts[i] for i in keep])
            if negative_sizes is not None:
                kwargs["negative_inputs"] = _KnownOrSources([negative_sizes[i] for i in keep], negatives)
        result = cls(records, images, split, where=where, on_empty_query=on_empty_query,
                     sizes=None if sizes is None else [sizes[i] for i in keep], **kwargs)
        result.skipped_rows = skipped
        return result

    # ------------------------------------------------------------------ access
    def __len__(self) -> int:
        return len(self.records)

    @property
    def positive_counts(self) -> Sequence[int]:
        """Per row, its number of positives (1 for a one-image column)."""
        if self._positive_counts is None:  # counted once: one per row, or each list's length
            self._positive_counts = [1] * len(self) if self._positives is None else [len(r) for r in self._positives]
        return self._positive_counts

    @property
    def positive_sources(self) -> Sequence[list[Any]]:
        """Per row, the list of its positives' undecoded sources."""
        return self._positives if self._positives is not None else _Singletons(self.image_sources)

    @property
    def negative_counts(self) -> Sequence[int]:
        """Per row, its number of hard negatives (all 0 without a hard-negatives column)."""
        if self.negative_sources is None:
            return [0] * len(self)
        if self._negative_counts is None:
            self._negative_counts = [len(row) for row in self.negative_sources]
        return self._negative_counts

    def __getitem__(self, index: int) -> dict[str, Any]:
        if isinstance(index, slice):
            raise TypeError("RetrievalDataset does not support slices; index one row at a time")
        return self.item(index)

    def item(self, index: int, positive: int = 0) -> dict[str, Any]:
        """Row ``index`` with its positive ``positive`` (of ``positive_counts[index]``) decoded as
        ``"image"`` and, for a row with several, the keys of the others as ``"relevant_keys"``
        (from their stored bytes; none is decoded). Raises ``IndexError`` for a positive the row
        does not have; a bad image as the module docstring says."""
        record = dict(self.records[index])
        name = self.row_name(index)
        part = None  # the hard negative or further positive being read, if any
        try:
            if self._positives is None:
                if positive != 0:
                    raise IndexError(f"{name} has 1 positive, not {positive + 1}")
                source, others = self.image_sources[index], []
            else:
                sources = self._positives[index]
                if not 0 <= positive < len(sources):
                    raise IndexError(f"{name} has {len(sources)} positives, not {positive + 1}")
                source, others = sources[positive], [(j, s) for j, s in enumerate(sources) if j != positive]
            record["image"] = load_image(source, max_source_pixels=self.max_source_pixels, name=name)
            record["doc_key"] = _page_key(source, record["image"])
            if self._positives is not None:
                keys = []
                for j, other in others:
                    part = f"positive {j}"
                    keys.append(_stored_key(other, name=f"{name}: {part}"))
                record["relevant_keys"] = keys
            if self.negative_sources is not None:
                negatives, keys = [], []
                for j, source in enumerate(self.negative_sources[index]):
                    part = f"hard negative {j}"
                    negatives.append(load_image(source, max_source_pixels=self.max_source_pixels, name=f"{name}: {part}"))
                    keys.append(_page_key(source, negatives[-1]))
                record["negatives"], record["negative_keys"] = negatives, keys
        except BadImageError as exc:
            if self.on_bad_image == "error":
                raise
            # the whole row goes; the short cause (the collator names the row by its id)
            record["image"], record["image_error"] = None, exc.reason if part is None else f"{part}: {exc.reason}"
        return record

    def row_name(self, index: int) -> str:
        """How errors refer to item ``index``: its source, row and id."""
        record = self.records[index]  # a row of several concatenated datasets names its own
        return f"{record.get('dataset', self.where)} row {record.get('row', index)} (id {record['id']!r})"

    def ids(self) -> list[str]:
        return [r["id"] for r in self.records]

    def image_inputs(self, choose=None) -> Sequence[Any]:
        """Per item, what a size estimate reads (``raggedvl.sampling.estimate_costs``): the
        manifest's (width, height) when it has one, else the undecoded image source (a path or a
        ``{"bytes", "path"}`` dict, of which only the header is read). ``choose``: for rows with
        several positives, a function from the row's list of positive inputs to the one to count
        (default: the first). With hard negatives, each row's entry is the list
        ``[image, *negatives]`` (its own negatives, any number), so a row's cost counts every
        image the collator encodes for it. Lazy: rows are read on access."""
        if choose is not None and self._positives is not None:
            images = _Chosen(self._positive_inputs if self._positive_inputs is not None else self._positives, choose)
        else:
            images = self.image_sources if self._sizes is None else _SizesOrSources(self._sizes, self.image_sources)
        if self.negative_sources is None:
            return images
        return _WithNegatives(images, self.negative_sources if self.negative_inputs is None else self.negative_inputs)

    def sample(self, limit: int | None) -> "RetrievalDataset":
        """The ``limit`` rows whose ids hash lowest, in their order (all rows for None): the same
        stable sample as the loaders' ``limit=``."""
        return self if limit is None else self.select(_limit_order(self.ids(), limit))

    def queries(self) -> list[str | None]:
        """Each row's query (None for a corpus-only row kept by ``on_empty_query="keep"``)."""
        return [r.get("query") for r in self.records]

    def select(self, positions: Sequence[int], *, negatives: bool = True) -> "RetrievalDataset":
        """A new dataset of the rows at ``positions`` (in that order), sharing the image sources
        and the source's ``skipped_rows``; ``negatives=False`` leaves out the hard negatives (a
        corpus of documents needs none)."""
        positions = [int(p) for p in positions]
        sizes = None if self._sizes is None else [self._sizes[p] for p in positions]
        sources = [self.image_sources[p] for p in positions]
        keep = negatives and self.negative_sources is not None
        several = self._positives is not None
        out = type(self)([self.records[p] for p in positions], sources, self.split, sizes=sizes,
                         on_bad_image=self.on_bad_image, max_source_pixels=self.max_source_pixels,
                         where=self.where, on_empty_query=self.on_empty_query,
                         negative_sources=_Picked(self.negative_sources, positions) if keep else None,
                         negative_counts=[self.negative_counts[p] for p in positions] if keep else None,
                         negative_inputs=(_Picked(self.negative_inputs, positions)
                                          if keep and self.negative_inputs is not None else None),
                         positive_sources=_Picked(self._positives, positions) if several else None,
                         positive_counts=[self.positive_counts[p] for p in positions] if several else None,
                         positive_inputs=(_Picked(self._positive_inputs, positions)
                                          if several and self._positive_inputs is not None else None))
        out.skipped_rows = list(self.skipped_rows)  # the source's rows left out stay reported (a subset holds none)
        return out

    def without_negative_pages(self, digests: set[str]) -> "RetrievalDataset":
        """The rows with every hard negative whose stored bytes have a SHA-256 (hex) in
        ``digests`` left out (reads each hard negative's bytes once; an unreadable one is kept,
        for the size estimate to name). ``self`` when nothing is left out."""
        if self.negative_sources is None:
            return self
        kept = []
        for row in self.negative_sources:
            keep = []
            for j, source in enumerate(row):
                try:
                    seen = hashlib.sha256(source_bytes(source)).hexdigest() in digests
                except (OSError, KeyError, TypeError):
                    seen = False
                if not seen:
                    keep.append(j)
            kept.append(keep)
        if all(len(k) == n for k, n in zip(kept, self.negative_counts)):
            return self
        out = self.select(range(len(self)), negatives=False)
        out.negative_sources = _Kept(self.negative_sources, kept)
        out._negative_counts = [len(k) for k in kept]
        out.negative_inputs = None if self.negative_inputs is None else _Kept(self.negative_inputs, kept)
        return out

    def duplicates(self) -> tuple[int, int]:
        """``(repeated queries, repeated rows)``: rows whose query text an earlier row already has,
        and of those the rows whose stored image is also that earlier row's (the same pair twice).
        Reads the image bytes of the rows with a repeated query only."""
        first_rows: dict[str, list[int]] = {}
        repeated_queries = repeated_rows = 0
        for row, query in enumerate(self.queries()):
            if query is None:
                continue
            earlier = first_rows.setdefault(query, [])
            if earlier:
                repeated_queries += 1
                digest = self._digest(row)
                repeated_rows += any(self._digest(e) == digest for e in earlier)
            earlier.append(row)
        return repeated_queries, repeated_rows

    def image_digests(self) -> list[str]:
        """SHA-256 (hex) of each row's encoded image bytes, as stored (file bytes, or the
        ``bytes`` of a ``datasets`` Image value), without decoding pixels. Two rows share a
        digest exactly when they hold byte-identical image files. Cached. Raises ``BadImageError``
        naming the row when an image cannot be read (under ``on_bad_image="skip"`` the digest
        is the row id's, so the row is unique)."""
        if getattr(self, "_digests", None) is None:
            self._digests = [self._digest(i) for i in range(len(self))]
        return list(self._digests)

    def page_digests(self) -> set[str]:
        """SHA-256 (hex) of every page the rows train on, as stored (no pixel decoded): each row's
        image (:meth:`image_digests`), its other positives and its hard negatives. A positive or
        hard negative whose bytes cannot be read is left out (the size estimate names it)."""
        digests = set(self.image_digests())
        for row in [*(self._positives or ()), *(self.negative_sources or ())]:
            for source in row:
                try:
                    digests.add(hashlib.sha256(source_bytes(source)).hexdigest())
                except (OSError, KeyError, TypeError):
                    continue
        return digests

    def _digest(self, index: int) -> str:
        try:
            data = source_bytes(self.image_sources[index])
        except (OSError, KeyError, TypeError) as exc:
            if self.on_bad_image == "skip":
                return "unreadable:" + hashlib.sha256(str(self.records[index]["id"]).encode()).hexdigest()
            raise unreadable_image(self.image_sources[index], self.row_name(index), exc) from exc
        return hashlib.sha256(data).hexdigest()

    def image_sizes(self) -> list[tuple[int, int] | None]:
        """(width, height) of each document image in pixels as displayed (EXIF orientation
        applied), without decoding pixels (from the manifest, else from each file's header,
        cached). An unreadable header gives None under ``on_bad_image="skip"`` and raises
        BadImageError naming the row under "error"."""
        if self._read_sizes is None:
            known = self._sizes or [None] * len(self)
            self._read_sizes = [size if size is not None else self._header_size(i) for i, size in enumerate(known)]
        return list(self._read_sizes)

    def _header_size(self, index: int) -> tuple[int, int] | None:
        try:
            return read_size(self.image_sources[index], name=self.row_name(index))
        except BadImageError:
            if self.on_bad_image == "skip":
                return None
            raise


def source_bytes(source: Any) -> bytes:
    """The stored bytes of an image source (a path, bytes, a ``{"bytes", "path"}`` dict, or a
    PIL image's mode, size and pixels). Raises ``OSError`` / ``KeyError`` / ``TypeError``."""
    if isinstance(source, dict):
        data = source.get("bytes")
        return Path(source["path"]).read_bytes() if data is None else data
    if isinstance(source, (bytes, bytearray)):
        return bytes(source)
    if isinstance(source, (str, os.PathLike)):
        return Path(source).read_bytes()
    if isinstance(source, Image.Image):
        return source.tobytes() + repr((source.mode, source.size)).encode()
    raise TypeError(f"unsupported image source {type(source).__name__}")


def _stored_key(source: Any, name: str) -> int:
    """The document key of an undecoded page (its stored bytes; a PIL image: its pixels).
    Raises ``BadImageError`` naming ``name`` when the bytes cannot be read."""
    try:
        return bytes_key(source_bytes(source))
    except (OSError, KeyError, TypeError) as exc:
        raise unreadable_image(source, name, exc) from exc


def _page_key(source: Any, image: Image.Image) -> int:
    """A page's document key (:mod:`raggedvl.data.keys`): its stored bytes, or its decoded pixels
    for a source without stored bytes."""
    try:
        return bytes_key(source_bytes(source))
    except (OSError, KeyError, TypeError):
        return image_key(image)


def _load_split(source: DataSource, split: str, found: ParquetSplit | None, cache_dir: str | os.PathLike | None = None,
                **load_kwargs):
    """``(rows, base_dir)`` of one split. Local parquet (:meth:`DataSource.parquet`:
    ``datasets``' split rules) is read as one memory-mapped Arrow table
    (``raggedvl.data.arrow_cache``; no ``datasets`` import); anything else, or parquet files
    whose schemas differ, through ``datasets.load_dataset`` (a ``datasets.Dataset``; local
    parquet read one row group at a time, without pre-buffering column chunks)."""
    path = source.path
    mapped = None if found is None or load_kwargs else mapped_split(found.files, cache_dir)
    if mapped is not None:
        return mapped, found.base_dir
    import datasets
    import pyarrow.dataset as ds

    row_group_reads = {"fragment_scan_options": ds.ParquetFragmentScanOptions(pre_buffer=False)}
    if source.kind == "parquet":
        splits = datasets.load_dataset("parquet", data_files={file_split(path): str(path)},
                                       **{**row_group_reads, **load_kwargs})
        return splits[pick_split(list(splits), split, source.name)], path.parent
    if path is not None:
        try:
            splits = datasets.load_dataset(str(path), **({**row_group_reads, **load_kwargs} if found else load_kwargs))
        except (ValueError, FileNotFoundError) as exc:
            raise ValueError(f"{path} is neither an rdocs directory nor a folder the datasets library can read ({exc})") from exc
        return splits[pick_split(list(splits), split, str(path))], path
    available = datasets.get_dataset_split_names(source.name, **{k: v for k, v in load_kwargs.items() if k == "name"})
    return datasets.load_dataset(source.name, split=pick_split(available, split, source.name), **load_kwargs), None


def _folder_file_ids(rows, column: str, folder: Path) -> list[str] | None:
    """Each row's image file path relative to ``folder``, ``/``-separated (``scans/page_003.png``):
    the ids of the rows of an image folder (``datasets``' folder builders keep each image as a
    ``{"bytes": None, "path"}`` value naming its file; one row per file, so the ids are unique).
    None when ``column`` is not such an ``Image`` column or a row's image is not a file under
    ``folder`` (stored bytes, a list of images, a path string): its rows keep ``<split>-<row>``."""
    import pyarrow as pa
    import pyarrow.compute as pc

    table = _arrow(_arrow_of_hf(rows))
    if column not in table.schema.names:
        return None
    kind = table.schema.field(column).type
    if not pa.types.is_struct(kind) or {kind.field(i).name for i in range(kind.num_fields)} != {"bytes", "path"}:
        return None
    cells = table.column(column)
    if pc.struct_field(cells, "bytes").null_count != len(cells) or pc.struct_field(cells, "path").null_count:
        return None
    root = Path(folder).resolve()
    ids = []
    for path in pc.struct_field(cells, "path").to_pylist():
        file = Path(path).resolve()
        if not file.is_relative_to(root):
            return None
        ids.append(file.relative_to(root).as_posix())
    return ids


def load_retrieval_dataset(
    name_or_path: str | os.PathLike,
    split: str = "train",
    *,
    limit: int | None = None,
    columns: Columns = Columns(),
    on_bad_image: BadImagePolicy = "error",
    on_empty_query: str = "error",
    cache_dir: str | os.PathLike | None = None,
    **load_kwargs,
) -> RetrievalDataset:
    """Load a split of a retrieval dataset with a query and an image column (``columns``:
    :class:`~raggedvl.data.columns.Columns`).

    ``name_or_path`` may be:
    - ``"rdocs"``: the embedded dataset (full build, cached; see ``build_rdocs`` for subsets),
      or a directory holding an rdocs ``manifest.jsonl``;
    - a local ``.parquet`` file: one split, named by the file's name as ``datasets`` names a folder's files
      (``dev.parquet`` is "validation"; a name without a split keyword, ``pairs.parquet``, is "train");
    - a local folder ``datasets`` can read (parquet files, or an image folder with a
      ``metadata.jsonl``/``metadata.csv``): its splits are inferred by ``datasets`` from the file
      names (``train*``, ``dev*``/``validation*``, ``test*``, the hub's ``data/<split>-*.parquet``);
      without ``columns.id``, the id of an image folder's row is its image file's path relative
      to the folder (``scans/page_003.png``);
    - a hub dataset id (``vidore/colpali_train_set``) through ``datasets.load_dataset``.
    ``split`` names one of the splits present; "dev" and "validation" (and the other
    ``raggedvl.data.scan.SPLIT_ALIASES``) find each other. A missing split is a ``ValueError`` listing those present.
    ``limit`` keeps a stable hash sample of that many rows. ``columns.negatives`` names a column
    of hard negatives (one image or a list of images per row; not for rdocs manifests, which have
    none). ``columns.source`` names a column (a manifest key) whose value is each row's
    ``"source_value"`` (one-source batches). Local parquet is read as one
    memory-mapped Arrow table in the cache under ``cache_dir`` (``raggedvl.data.arrow_cache``),
    without ``datasets``; extra ``load_kwargs`` send every source through ``datasets.load_dataset``.
    """
    if on_empty_query not in EMPTY_QUERY_POLICIES:
        raise ValueError(f"on_empty_query must be one of {EMPTY_QUERY_POLICIES}, got {on_empty_query!r}")
    common = {"on_bad_image": on_bad_image, "on_empty_query": on_empty_query}
    source = DataSource.of(name_or_path)
    if columns.negatives is not None and source.is_manifest:
        raise ValueError(f"{name_or_path} is an rdocs manifest, which has no hard-negatives column "
                         f"{columns.negatives!r}; leave Columns(negatives=...) unset or load a parquet file that has one")
    if source.kind == "rdocs":
        from raggedvl.data.rdocs import build_rdocs

        return RetrievalDataset.from_manifest(build_rdocs(cache_dir), split, limit=limit, source_column=columns.source,
                                              **common)
    if source.kind == "manifest":
        return RetrievalDataset.from_manifest(source.path, split, limit=limit, source_column=columns.source, **common)

    if source.kind == "beir":
        return _by_reference(source.path, split, cache_dir=cache_dir, limit=limit, **common)
    found = source.parquet(split)  # local parquet: its files and columns, once
    rows, base = _load_split(source, split, found, cache_dir, **load_kwargs)
    schema = rows.features.arrow_schema if hasattr(rows, "features") else _arrow(rows).schema
    several = columns.image in schema.names and is_list_type(schema.field(columns.image).type)
    ids = _folder_file_ids(rows, columns.image, source.path) if source.kind == "folder" and found is None else None
    return RetrievalDataset.from_hf(
        rows, split, columns=columns, limit=limit, base_dir=base, where=f"{name_or_path} split {split!r}", ids=ids,
        sizes=_cached_sizes(found, columns.image, _num_rows(rows), "positive" if several else None),
        negative_sizes=(None if columns.negatives is None
                        else _cached_sizes(found, columns.negatives, _num_rows(rows), "hard negative")),
        **common,
    )


def _by_reference(root: Path, split: str, *, cache_dir, limit: int | None, on_bad_image: BadImagePolicy,
                  on_empty_query: str) -> RetrievalDataset:
    """A BEIR folder as training rows referring to its corpus (:mod:`raggedvl.data.by_reference`)."""
    from raggedvl.data.by_reference import Referenced, referenced_rows
    from raggedvl.data.scan import image_sizes

    held = referenced_rows(root, split)
    corpus = held["corpus"]
    table = mapped_split(corpus.files, cache_dir)
    if table is None:
        raise ValueError(f"{corpus.where}: the corpus files' schemas differ; re-write them with one schema")
    pages = _ImageColumn(table, held["image_column"], list(range(corpus.num_rows)), corpus.base_dir)
    scanned = image_sizes(corpus, held["image_column"])  # each page's header once, cached beside the data
    sizes = [None if w < 0 else (w, h) for w, h in scanned.sizes.tolist()]
    keep, skipped = kept_rows(held["queries"], held["query_ids"], str(root), on_empty_query, limit)
    positives = Referenced(pages, [held["positives"][i] for i in keep])
    records = [{"query": held["queries"][i], "id": held["query_ids"][i], "row": i} for i in keep]
    kwargs: dict[str, Any] = {
        "positive_sources": positives, "positive_counts": [len(held["positives"][i]) for i in keep],
        "positive_inputs": _KnownOrSources([[sizes[p] for p in held["positives"][i]] for i in keep], positives),
    }
    if held["has_negatives"]:
        negatives = Referenced(pages, [held["negatives"][i] for i in keep])
        kwargs.update(negative_sources=negatives, negative_counts=[len(held["negatives"][i]) for i in keep],
                      negative_inputs=_KnownOrSources([[sizes[p] for p in held["negatives"][i]] for i in keep],
                                                      negatives))
    dataset = RetrievalDataset(records, _Firsts(positives), split, sizes=[sizes[held["positives"][i][0]] for i in keep],
                               on_bad_image=on_bad_image, where=f"{root} (corpus by reference)",
                               on_empty_query=on_empty_query, **kwargs)
    dataset.skipped_rows = skipped
    return dataset


def _num_rows(rows) -> int:
    return _arrow(rows).num_rows if isinstance(rows, MappedTable) else len(rows)


def _cached_sizes(table: ParquetSplit | None, column: str, num_rows: int,
                  item: str | None = None) -> list[Any] | None:
    """Each row's image size from ``raggedvl.data.scan``'s cache of a local parquet split (the
    launcher writes it), None for an unreadable image; with ``item`` (a column of image lists,
    ``"positive"`` or ``"hard negative"``) per row the list of its images' sizes. None when
    there is no cache entry (the sizes are then read from the headers when needed)."""
    from raggedvl.data.scan import cached_image_sizes

    found = cached_image_sizes(table, column, item=item) if table is not None else None
    if found is None or table.num_rows != num_rows:
        return None
    if item is None:
        return [None if width < 0 else (width, height) for width, height in found.sizes.tolist()]
    return [[None if w < 0 else (w, h) for w, h in row[:count]]
            for row, count in zip(found.sizes.tolist(), found.counts.tolist())]

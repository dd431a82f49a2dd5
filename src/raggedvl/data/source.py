"""What a dataset name points at, decided once: :class:`DataSource`.

| ``kind`` | name | read by |
|---|---|---|
| ``rdocs`` | the preset ``"rdocs"`` (built and cached by :func:`raggedvl.data.build_rdocs`) | the manifest reader |
| ``manifest`` | a folder holding an rdocs ``manifest.jsonl`` | the manifest reader |
| ``beir`` | a local folder of ``corpus*`` / ``queries*`` / ``qrels*`` parts | the BEIR reader (:mod:`raggedvl.evaluation.benchmark`) |
| ``parquet`` | a local ``.parquet`` file: one split named by the file name | Arrow, memory-mapped (no ``datasets``) |
| ``folder`` | any other local folder: splits by ``datasets``' file-name rules | Arrow for parquet files, else ``datasets`` |
| ``hub`` | anything else: a hub dataset id; BEIR when its configs hold corpus, queries and qrels | ``datasets`` |

Deciding the kind of a local name reads the folder's entries only (no torch, no ``datasets``);
:meth:`DataSource.parquet` finds a split's parquet files and columns from their footers, which
the launcher's checks, the ranks' loaders and evaluation use alike."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from raggedvl.data.scan import ParquetSplit, file_split, folder_splits, is_beir_layout, parquet_split

Kind = Literal["rdocs", "manifest", "beir", "parquet", "folder", "hub"]


@dataclass(frozen=True)
class DataSource:
    """``name`` as given, its ``kind`` (module table) and, for local kinds, its ``path``."""

    name: str
    kind: Kind
    path: Path | None = None

    @classmethod
    def of(cls, name: str | os.PathLike) -> DataSource:
        """The source ``name`` points at. Raises ``ValueError`` for a local file that is not
        ``.parquet``."""
        text = str(name)
        if text == "rdocs":
            return cls(text, "rdocs")
        path = Path(name).expanduser()
        if path.is_file():
            if path.suffix != ".parquet":
                raise ValueError(f"{path}: a single file must be .parquet (or pass a folder the datasets library can read)")
            return cls(text, "parquet", path)
        if path.is_dir():
            if (path / "manifest.jsonl").is_file():
                return cls(text, "manifest", path)
            return cls(text, "beir" if is_beir_layout(path) else "folder", path)
        return cls(text, "hub")

    @property
    def is_manifest(self) -> bool:
        """An rdocs manifest (the preset or a built folder): no parquet columns, no hard negatives."""
        return self.kind in ("rdocs", "manifest")

    def parquet(self, split: str) -> ParquetSplit | None:
        """The split's local parquet files and columns; None for a source that is not local
        parquet (a manifest, a BEIR layout, an image folder, a hub id). Raises ``ValueError``
        naming the splits present when ``split`` is missing (:func:`raggedvl.data.scan.parquet_split`)."""
        return parquet_split(self.path, split) if self.kind in ("parquet", "folder") else None

    def default_split(self, preferred: str) -> str:
        """The split a command reads when none is named: the one split of a local ``.parquet``
        file or of a folder whose files make one split by ``datasets``' file-name rules (a folder
        of page images, ``pairs.parquet``: "train"), else ``preferred`` (also for a folder with a
        dataset card, whose configs may name other splits). Reads no data file
        (:func:`raggedvl.data.scan.folder_splits`)."""
        if self.kind == "parquet":
            return file_split(self.path)
        if self.kind == "folder" and not (self.path / "README.md").exists():
            splits = folder_splits(self.path)
            if splits is not None and len(splits) == 1:
                return next(iter(splits))
        return preferred

    def is_beir(self) -> bool:
        """A BEIR layout: a local one, or a hub dataset whose configs hold ``corpus``, ``queries``
        and ``qrels`` (asks the hub once; an unreachable hub counts as no)."""
        return self.kind == "beir" or (self.kind == "hub" and _hub_is_beir(self.name))


@functools.cache
def _hub_is_beir(name: str) -> bool:
    import datasets

    try:
        configs = datasets.get_dataset_config_names(name)
    except Exception:  # noqa: BLE001 - an unreachable hub: the pairs loader's error names it
        return False
    return {"corpus", "queries", "qrels"} <= set(configs)

"""An on-disk index of document embeddings: safetensors shards plus ids, written by
``raggedvl encode`` and read by ``raggedvl search``.

Layout of an index folder::

    index.json                  {"format": "raggedvl-index", "version": 1, "kind":
                                 "multi_vector" | "single_vector", "dim", "dtype", "documents",
                                 "shards": [{"file", "documents", "ids"}...], "model", "dataset"}
    shard-00000.safetensors     multi-vector: "embeddings" [T, D] (every document's valid vectors,
                                concatenated) and "offsets" [n + 1] int64 (document j's vectors are
                                rows offsets[j]:offsets[j+1]); single vector: "embeddings" [n, D]

Shards are memory-mapped by safetensors on load and read one at a time, so a search holds one
shard's chunk in memory. No pickle is involved.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from raggedvl.evaluation.search import Chunk, pad_rows

INDEX_FORMAT = "raggedvl-index"
INDEX_VERSION = 1


def write_shard(directory: str | os.PathLike, number: int, rows: Sequence[torch.Tensor], ids: Sequence[str],
                dtype: torch.dtype = torch.float16) -> dict[str, Any]:
    """Write one shard of ``rows`` (``[L_i, D]`` or ``[D]``) and return its index entry."""
    if len(rows) != len(ids):
        raise ValueError(f"{len(rows)} embeddings but {len(ids)} ids")
    name = f"shard-{number:05d}.safetensors"
    if rows and rows[0].ndim == 1:
        tensors = {"embeddings": torch.stack(list(rows)).to(dtype).contiguous()}
    else:
        lengths = torch.tensor([0] + [r.shape[0] for r in rows], dtype=torch.long)
        dim = rows[0].shape[-1] if rows else 0
        flat = torch.cat(list(rows)) if rows else torch.zeros(0, dim)
        tensors = {"embeddings": flat.to(dtype).contiguous(), "offsets": lengths.cumsum(0)}
    path = Path(directory) / name
    save_file(tensors, str(path), metadata={"format": INDEX_FORMAT})
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)  # save_file creates 0600; the umask's mode, as index.json gets from open()
    return {"file": name, "documents": len(ids), "ids": [str(i) for i in ids]}


def write_index(directory: str | os.PathLike, shards: Sequence[dict[str, Any]], *, kind: str, dim: int, dtype: torch.dtype,
                **info: Any) -> Path:
    """Write ``index.json`` over shard entries (in corpus order). Raises ``ValueError`` for a
    repeated document id."""
    ids = [i for s in shards for i in s["ids"]]
    if len(set(ids)) != len(ids):
        raise ValueError(f"the index would hold {len(ids) - len(set(ids))} repeated document ids")
    meta = {"format": INDEX_FORMAT, "version": INDEX_VERSION, "kind": kind, "dim": dim, "dtype": str(dtype).removeprefix("torch."),
            "documents": len(ids), "shards": list(shards), **info}
    path = Path(directory) / "index.json"
    path.write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
    return path


class EmbeddingIndex:
    """Read side of an index folder. ``ids`` [N] in corpus order; :meth:`chunks` yields the
    documents as search chunks of at most ``chunk_size`` documents (float32)."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)
        meta_path = self.directory / "index.json"
        if not meta_path.is_file():
            raise ValueError(f"{self.directory} is not an embedding index (no index.json); build one with raggedvl encode")
        try:
            self.meta = json.loads(meta_path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{meta_path} is not readable JSON ({exc}); the index is damaged: build it again with "
                             "raggedvl encode") from None
        if self.meta.get("format") != INDEX_FORMAT or self.meta.get("version") != INDEX_VERSION:
            raise ValueError(f"{meta_path}: format {self.meta.get('format')!r} version {self.meta.get('version')!r} is not a "
                             f"{INDEX_FORMAT} v{INDEX_VERSION}")
        self.ids = [i for s in self.meta["shards"] for i in s["ids"]]
        self.multi_vector = self.meta["kind"] == "multi_vector"

    def __len__(self) -> int:
        return len(self.ids)

    def chunks(self, chunk_size: int = 1024) -> Iterator[Chunk]:
        offset = 0
        for shard in self.meta["shards"]:
            path = self.directory / shard["file"]
            if not path.is_file():
                raise ValueError(f"index shard {path} is missing")
            try:
                opened = safe_open(str(path), framework="pt")
            except Exception as exc:  # safetensors raises its own SafetensorError for a damaged file
                raise ValueError(f"index shard {path} is damaged ({exc}); build the index again with raggedvl encode") from None
            with opened as f:
                n = shard["documents"]
                if not self.multi_vector:
                    emb = f.get_tensor("embeddings")
                    for start in range(0, n, chunk_size):
                        yield offset + start, emb[start:start + chunk_size].float(), None
                else:
                    flat, offsets = f.get_slice("embeddings"), f.get_tensor("offsets")
                    if offsets.shape[0] != n + 1:
                        raise ValueError(f"{path}: {offsets.shape[0] - 1} documents in offsets, index.json says {n}")
                    for start in range(0, n, chunk_size):
                        stop = min(n, start + chunk_size)
                        lo, hi = int(offsets[start]), int(offsets[stop])
                        block = flat[lo:hi].float()
                        rows = [block[int(offsets[j]) - lo:int(offsets[j + 1]) - lo] for j in range(start, stop)]
                        emb, mask = pad_rows(rows)
                        del block, rows  # only the padded chunk stays alive while the caller scores it
                        yield offset + start, emb, mask
                        del emb, mask
            offset += shard["documents"]

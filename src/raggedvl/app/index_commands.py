"""``raggedvl encode`` (document embeddings -> an index folder) and ``raggedvl search`` (top-k of
queries over an index), for any checkpoint ``raggedvl eval`` loads."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

from raggedvl import __version__
from raggedvl.evaluation.encode import document_collate, document_sizes, encode_shard
from raggedvl.evaluation.index import EmbeddingIndex, write_index, write_shard
from raggedvl.evaluation.ranking import tie_keys
from raggedvl.evaluation.search import search
from raggedvl.parallel import all_gather_objects, barrier, init_distributed, shutdown
from raggedvl.app.column_flags import flags_for_columns
from raggedvl.app.evaluate_checkpoint import checkpoint_collator, load_model
from raggedvl.app.rundir import check_new_folder
from raggedvl.data.columns import Columns
from raggedvl.data.source import DataSource
from raggedvl.app.wording import counted


def encode_corpus(checkpoint: str | Path, *, dataset: str, split: str | None = None, output: str | Path,
                  batch_size: int = 8, on_bad_image: str = "error", dtype: torch.dtype = torch.float16,
                  columns: Columns = Columns(query=None)) -> Path:
    """Encode every distinct document image of ``dataset`` (a folder of page images, a BEIR
    corpus, or the distinct images of (query, image) rows; no query is read) into an index
    folder (``raggedvl.evaluation.index``). ``split`` None: the dataset's one split, else "test"
    (:meth:`~raggedvl.data.source.DataSource.default_split`). Under torchrun each rank encodes a
    contiguous shard and writes its own safetensors file; rank 0 writes ``index.json``.
    Unreadable images under ``on_bad_image="skip"`` are left out and counted. ``columns``: the
    rows' image and id columns (the ids are what ``search`` prints; no id column: a BEIR
    corpus's ids, an image folder's file paths relative to it, else ``<split>-<row>``). Refuses,
    before loading the model or any collective, an ``output`` that already holds files
    (:func:`~raggedvl.app.rundir.check_new_folder`), and a missing column, naming
    ``--image-column``... (``ValueError``)."""
    from raggedvl.evaluation.benchmark import load_corpus

    out = Path(output)
    check_new_folder(out, "encode")
    split = split or DataSource.of(dataset).default_split("test")
    info = init_distributed()
    try:
        model, processor, cfg, described = load_model(Path(checkpoint), info.device)
        with flags_for_columns(keys=False):
            docs = load_corpus(dataset, split, on_bad_image=on_bad_image, columns=columns)
        collate = checkpoint_collator(model, processor, cfg, on_bad_image=on_bad_image)
        lo, rows = encode_shard(model, len(docs), document_collate(collate, docs), document_sizes(docs), batch_size=batch_size,
                                device=info.device, desc="documents", progress=info.is_main)
        ids = docs.ids()
        kept = sorted(rows)
        out.mkdir(parents=True, exist_ok=True)
        entry = write_shard(out, info.rank, [rows[p] for p in kept], [ids[p] for p in kept], dtype=dtype) if kept else None
        entries = all_gather_objects(entry)
        shards = [e for e in entries if e is not None]
        first = next((rows[p] for p in kept), None)
        dims = [d for d in all_gather_objects(None if first is None else (first.ndim, first.shape[-1])) if d is not None]
        if not dims:
            raise ValueError(f"{dataset}: no document could be encoded")
        if info.is_main:
            kind = "single_vector" if dims[0][0] == 1 else "multi_vector"
            skipped = len(docs) - sum(s["documents"] for s in shards)
            write_index(out, shards, kind=kind, dim=dims[0][1], dtype=dtype, model=described, dataset=str(dataset), split=split,
                        skipped_documents=skipped, raggedvl_version=__version__)
            print(f"{counted(sum(s['documents'] for s in shards), 'document')} ({skipped} skipped) in "
                  f"{counted(len(shards), 'shard')}: {out}")
        barrier()
        return out
    finally:
        shutdown()


def search_index(checkpoint: str | Path, *, index: str | Path, queries: list[str], k: int = 10, chunk_size: int = 1024,
                 batch_size: int = 32, allow_other_model: bool = False) -> list[list[tuple[str, float]]]:
    """Top-``k`` (document id, score) of each query over ``index``, best first, exact (chunked
    MaxSim or dot products; ties in trec_eval's order). One process. Raises ``ValueError`` when
    the index was built by a model with another head or dimension, or (unless
    ``allow_other_model``) by another checkpoint or step than ``checkpoint`` (the index records
    which: ``index.json``'s ``model``)."""
    idx = EmbeddingIndex(index)
    info = init_distributed()
    try:
        model, processor, cfg, described = load_model(Path(checkpoint), info.device)
        if not allow_other_model:
            check_same_model(described, idx.meta.get("model"), index)
        collate = checkpoint_collator(model, processor, cfg)
        from raggedvl.evaluation.encode import encode_queries

        encoded: Any = encode_queries(model, collate, queries, batch_size=batch_size, device=info.device, progress=False, padded=True)
        q_emb, q_mask = (encoded, None) if isinstance(encoded, torch.Tensor) else encoded
        if (q_mask is not None) != idx.multi_vector or q_emb.shape[-1] != idx.meta["dim"]:
            raise ValueError(f"{index} holds {idx.meta['kind']} embeddings of dim {idx.meta['dim']}; the model gives "
                             f"{'multi' if q_mask is not None else 'single'}-vector embeddings of dim {q_emb.shape[-1]}")
        top = search(q_emb, q_mask, idx.chunks(chunk_size), k, tie_keys(idx.ids))
        return [[(idx.ids[int(d)], float(s)) for d, s in zip(row_i, row_s)] for row_i, row_s in zip(top.indices, top.scores)]
    finally:
        shutdown()


def _model_name(described: dict[str, Any]) -> str:
    return str(described.get("path")) + (f" (step {described['step']})" if "step" in described else "")


def check_same_model(ours: dict[str, Any], theirs: dict[str, Any] | None, index: str | Path) -> None:
    """Raise ``ValueError`` (one line naming both) when the index's model (``index.json``'s
    ``model``: checkpoint path and step) is not ``ours``; an index that records none is accepted."""
    if not theirs or "path" not in theirs:
        return
    same_path = Path(str(theirs["path"])).resolve() == Path(str(ours["path"])).resolve()
    if same_path and theirs.get("step") == ours.get("step"):
        return
    raise ValueError(f"{index} was encoded by {_model_name(theirs)}, not by {_model_name(ours)}: its document "
                     "embeddings do not match this model's queries; encode the corpus with this checkpoint "
                     "(raggedvl encode) or pass --allow-other-model")


def print_results(queries: list[str], results: list[list[tuple[str, float]]], file=None) -> None:
    file = sys.stdout if file is None else file
    for query, hits in zip(queries, results):
        print(f"query: {query}", file=file)
        for rank, (doc, score) in enumerate(hits, 1):
            print(f"  {rank:>3}  {score:10.4f}  {doc}", file=file)

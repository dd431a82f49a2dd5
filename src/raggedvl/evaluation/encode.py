"""Encode queries and document images with a retriever: size-bucketed batches, progress, and
(for evaluation and indexing) contiguous shards over ranks.

Progress (:func:`progress_calls`): a tqdm bar when stderr is a terminal; in a log file or a
pipe, plain lines with no carriage return (``documents: batch 4/40 (10 %) 2.10 batches/s ETA
0:00:17``), as ``raggedvl train`` prints its steps (``raggedvl.app.progress``).

Shape legend: n items, L_i valid vectors of item i, D embedding dim.

Outputs are CPU float32: per item a ``[L_i, D]`` tensor of its valid vectors (multi-vector
head) or a ``[D]`` vector (bi-encoder). Batches are formed after sorting the items by size
(image area for documents, characters for queries), so a batch pads little; results come back
in input order.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any, TextIO

import torch
from tqdm.auto import tqdm

from raggedvl.parallel import get_rank, get_world_size


def valid_rows(emb: torch.Tensor, mask: torch.Tensor | None) -> list[torch.Tensor]:
    """Per item: its valid vectors ``[L_i, D]`` (mask True), or its vector ``[D]`` (no mask)."""
    if mask is None:
        return [e.float().cpu() for e in emb]
    return [e[m].float().cpu() for e, m in zip(emb, mask.bool())]


def shard_bounds(n: int, rank: int, world_size: int) -> tuple[int, int]:
    """This rank's contiguous ``[lo, hi)`` of ``n`` items (ceil(n / W) per rank, the last ones
    may be short or empty)."""
    per = math.ceil(n / world_size) if n else 0
    return min(n, rank * per), min(n, (rank + 1) * per)


def progress_calls(total: int, *, desc: str | None = None, enabled: bool = True,
                   stream: TextIO | None = None) -> Iterator[int]:
    """``0 .. total - 1``, showing progress on ``stream`` (default stderr) when ``enabled``: a
    tqdm bar when it is a terminal, else one plain line (no carriage return) after every tenth
    of the calls and after the last, ``DESC: batch I/TOTAL (P %) R batches/s ETA H:MM:SS``."""
    stream = stream or sys.stderr
    if not enabled or total <= 0:
        yield from range(total)
        return
    if stream.isatty():
        yield from tqdm(range(total), desc=desc, dynamic_ncols=True, file=stream)
        return
    every, t0, label = max(1, math.ceil(total / 10)), time.perf_counter(), f"{desc}: " if desc else ""
    for call in range(total):
        yield call
        done = call + 1
        if done % every and done != total:
            continue
        elapsed = max(1e-9, time.perf_counter() - t0)
        eta = elapsed / done * (total - done)
        print(f"{label}batch {done}/{total} ({100 * done // total} %) {done / elapsed:.2f} batches/s "
              f"ETA {timedelta(seconds=round(eta))}", file=stream, flush=True)


@torch.no_grad()
def encode_in_batches(
    model: torch.nn.Module,
    positions: Sequence[int],
    collate: Callable[[list[int]], tuple[Any, list[int]]],
    *,
    batch_size: int,
    device: torch.device | str = "cpu",
    autocast: Any = None,
    n_calls: int | None = None,
    filler: int | None = None,
    desc: str | None = None,
    progress: bool = False,
) -> dict[int, torch.Tensor]:
    """Encode ``positions`` (already in bucket order) in batches of ``batch_size``.

    ``collate(positions)`` returns (a model input batch, the positions it kept: a position it
    could not use, e.g. a skipped image, is left out), or (None, []) when it kept none; that call
    encodes the previous batch again and drops the output (the call counts stay equal across
    ranks); with no previous batch it is left out, or, with ``n_calls``, encodes the stand-in
    position (``filler``, default the first position) and drops the output. ``n_calls``: make
    exactly this many forward calls, encoding position ``filler`` (default: the first position)
    and dropping its output when there are fewer real batches, so every rank of a sharded job
    makes the same calls (FSDP2 runs collectives inside forward). ``progress``: show
    :func:`progress_calls` (labelled ``desc``) on stderr.
    Returns position -> embedding rows (see module docstring). Raises ``ValueError`` when, with
    ``n_calls``, a call has neither a readable item, nor an earlier batch, nor a readable stand-in
    (raised before that call's forward, so the job fails instead of leaving the other ranks waiting)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    positions = list(positions)
    batches = [positions[i:i + batch_size] for i in range(0, len(positions), batch_size)]
    calls = len(batches) if n_calls is None else n_calls
    if calls < len(batches):
        raise ValueError(f"n_calls={calls} is fewer than the {len(batches)} batches to encode")
    was_training = model.training
    model.eval()
    out: dict[int, torch.Tensor] = {}
    previous = None  # the last batch encoded, repeated in place of a batch whose every item was skipped
    ctx = autocast or contextlib.nullcontext()
    try:
        for call in progress_calls(calls, desc=desc, enabled=progress):
            real = call < len(batches)
            if not real and filler is None and not positions:
                raise ValueError("n_calls exceeds the batches and there is no item to repeat: pass filler=")
            batch, kept = collate(batches[call] if real else [positions[0] if filler is None else filler])
            if batch is None:  # nothing left to encode in this batch: repeat the last one, output dropped
                batch, kept = previous, []
                if batch is None and n_calls is not None:  # lockstep: this call happens on every rank
                    stand_in = positions[0] if filler is None else filler
                    batch, _ = collate([stand_in])
                    if batch is None:
                        raise ValueError(
                            f"batch {call + 1} of {calls} (positions {batches[call][:8]}) has no readable item, nor has "
                            f"the stand-in position {stand_in}, and nothing was encoded before it: the other ranks "
                            f"would wait for this rank's forward call; remove the unreadable files or put a readable "
                            f"document first")
                if batch is None:
                    continue
            previous = batch
            with ctx:
                result = model(**batch.to(device))
            if real and kept:
                out.update(zip(kept, valid_rows(result.embeddings, result.mask)))
    finally:
        model.train(was_training)
    return out


def bucket_order(sizes: Sequence[float | None]) -> list[int]:
    """Positions sorted by size, largest first (unknown sizes last, in input order)."""
    return sorted(range(len(sizes)), key=lambda i: (sizes[i] is None, -(sizes[i] or 0), i))


def _image_area(item: Any) -> float | None:
    size = getattr(item, "size", None)
    return float(size[0] * size[1]) if isinstance(size, tuple) and len(size) == 2 else None


def as_output(rows: list[torch.Tensor], padded: bool):
    """The public return forms: ragged list, or (padded ``[n, L_max, D]``, bool mask
    ``[n, L_max]``); single vectors stack into ``[n, D]`` either way."""
    if rows and rows[0].ndim == 1:
        return torch.stack(rows)
    if not padded:
        return rows
    from raggedvl.evaluation.search import pad_rows

    return pad_rows(rows)


def encode_queries(model: torch.nn.Module, collator: Any, texts: Sequence[str], *, batch_size: int = 32,
                   device: torch.device | str = "cpu", autocast: Any = None, progress: bool = True, padded: bool = False):
    """Embeddings of query ``texts`` in input order (``collator``: a
    :class:`raggedvl.data.RetrievalCollator`; its query template and augmentation are applied).
    Returns a list of ``[L_i, D]`` (default), ``(emb [n, L_max, D], mask [n, L_max])`` with
    ``padded=True``, or ``[n, D]`` for a bi-encoder."""
    texts = list(texts)
    order = bucket_order([float(len(t)) if isinstance(t, str) else None for t in texts])
    rows = encode_in_batches(model, order, lambda pos: (collator.collate_queries([texts[p] for p in pos]), pos),
                             batch_size=batch_size, device=device, autocast=autocast, desc="queries", progress=progress)
    return as_output([rows[i] for i in range(len(texts))], padded)


def document_collate(collator: Any, documents: Sequence[Any]) -> Callable[[list[int]], tuple[Any, list[int]]]:
    """A ``collate`` for :func:`encode_in_batches` over ``documents`` (images, paths, bytes, or a
    dataset whose rows hold an ``image``); positions whose image is skipped are left out, and a
    batch of skipped images only is ``(None, [])``."""
    def collate(positions: list[int]):
        examples = []
        for p in positions:
            item = documents[p]
            examples.append({"image": item["image"], "id": str(item.get("id", p)), **({"image_error": item["image_error"]} if "image_error" in item else {})}
                            if isinstance(item, dict) else {"image": item, "id": str(p)})
        out = collator.collate_documents(examples)
        if out["docs"] is None:  # every image of these positions was skipped
            return None, []
        kept_ids = set(out["ids"])
        kept = [p for p, e in zip(positions, examples) if e["id"] in kept_ids]
        return out["docs"], kept
    return collate


def document_sizes(documents: Sequence[Any]) -> list[float | None]:
    """Image areas for bucketing, without decoding where the dataset knows them."""
    sizes = getattr(documents, "image_sizes", None)
    if callable(sizes):
        return [None if s is None else float(s[0] * s[1]) for s in sizes()]
    return [_image_area(d) for d in documents]


def encode_documents(model: torch.nn.Module, collator: Any, documents: Sequence[Any], *, batch_size: int = 8,
                     device: torch.device | str = "cpu", autocast: Any = None, progress: bool = True, padded: bool = False):
    """Embeddings of document images in input order (``documents``: PIL images, paths, bytes, or a
    :class:`raggedvl.data.RetrievalDataset`). Same return forms as :func:`encode_queries`.
    Raises ``ValueError`` when an image is skipped (``on_bad_image="skip"``): use
    :func:`encode_in_batches` with :func:`document_collate` to handle skips yourself."""
    order = bucket_order(document_sizes(documents))
    rows = encode_in_batches(model, order, document_collate(collator, documents), batch_size=batch_size, device=device,
                             autocast=autocast, desc="documents", progress=progress)
    missing = [i for i in range(len(documents)) if i not in rows]
    if missing:
        raise ValueError(f"documents {missing[:8]} were skipped (unreadable images); {len(missing)} in all")
    return as_output([rows[i] for i in range(len(documents))], padded)


def model_collator(model: torch.nn.Module, processor: Any = None) -> Any:
    """The :class:`raggedvl.data.RetrievalCollator` that writes inputs as ``model`` (a
    :class:`raggedvl.models.Retriever`) was trained with: its prompts and family, and
    ``processor`` (default: the one ``build_retriever`` attached). Raises ``ValueError`` when
    there is no processor."""
    from raggedvl.data import RetrievalCollator

    processor = processor if processor is not None else getattr(model, "processor", None)
    if processor is None:
        raise ValueError("encoding needs the model's processor: pass processor= (raggedvl.build_processor(...)) "
                         "or build the model with build_retriever(..., processor=...)")
    return RetrievalCollator(processor, prompts=model.config.prompts, layout=model.family.name)


def embed_queries(model: torch.nn.Module, texts: Sequence[str], *, processor: Any = None, batch_size: int = 32,
                  progress: bool = True, padded: bool = False):
    """Query embeddings of a :class:`raggedvl.models.Retriever`, without gradient, on the
    model's device: :func:`encode_queries` with :func:`model_collator`. Returns a list of
    ``[L_i, D]``, ``(emb [n, L_max, D], mask [n, L_max])`` with ``padded=True``, or ``[n, D]``
    for a bi-encoder."""
    device = next(model.parameters()).device
    with torch.no_grad():
        return encode_queries(model, model_collator(model, processor), texts, batch_size=batch_size, device=device,
                              progress=progress, padded=padded)


def embed_documents(model: torch.nn.Module, documents: Sequence[Any], *, processor: Any = None, batch_size: int = 8,
                    progress: bool = True, padded: bool = False):
    """Document embeddings of a :class:`raggedvl.models.Retriever` for page images (PIL images,
    paths, bytes, or a RetrievalDataset), without gradient, bucketed by image area: same return
    forms as :func:`embed_queries`. Raises ``BadImageError`` (a ``ValueError``) naming an
    unreadable image."""
    device = next(model.parameters()).device
    with torch.no_grad():
        return encode_documents(model, model_collator(model, processor), documents, batch_size=batch_size,
                                device=device, progress=progress, padded=padded)


def encode_shard(model, n: int, collate, sizes: Sequence[float | None], *, batch_size: int, device, autocast=None,
                 desc: str | None = None, progress: bool = False) -> tuple[int, dict[int, torch.Tensor]]:
    """This rank's contiguous shard of ``n`` items, encoded in size buckets with the same number
    of forward calls on every rank. Returns (shard start, position -> rows)."""
    rank, world = get_rank(), get_world_size()
    lo, hi = shard_bounds(n, rank, world)
    calls = math.ceil(math.ceil(n / world) / batch_size) if n else 0
    order = [lo + i for i in bucket_order(list(sizes[lo:hi]))]
    return lo, encode_in_batches(model, order, collate, batch_size=batch_size, device=device, autocast=autocast,
                                 n_calls=calls, filler=0, desc=desc, progress=progress)

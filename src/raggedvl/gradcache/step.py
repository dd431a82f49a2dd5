"""GradCache for ragged retrieval batches: the contrastive loss over a rank's whole batch (and,
through the loss's gather, the global batch) with activation memory of one chunk.

Method: Gao, Zhang, Han & Callan (2021), "Scaling Deep Contrastive Learning Batch Size under
Memory Limited Setup". With z = f_theta(x) the embeddings and L(z) the loss,
dL/dtheta = sum over chunks c of (dL/dz_c)^T dz_c/dtheta, so the loss can be differentiated
w.r.t. cached embeddings first and each chunk's encoder backward run later, one at a time.

Shape legend: B samples on this rank, L token columns (padded), D embedding dim.

One optimizer step on every rank (:func:`grad_cache_step`):

1. Queries and documents are cut into chunks of at most ``budget`` patches + tokens
   (:mod:`raggedvl.gradcache.chunking`). Each chunk is encoded under ``torch.no_grad()``, one
   ``model(**chunk)`` call each; the CPU (and current CUDA device) RNG state is saved before
   every chunk's forward.
2. The chunk outputs are assembled into leaf tensors (``[B, D]``, or ``[B, L, D]`` with the
   mask, zero-padded) with ``requires_grad=True``; the loss is computed ONCE on them (a
   cross-rank loss gathers across ranks here, once) and back-propagated to them.
3. Each chunk is re-encoded with its RNG state replayed (identical dropout masks, case C07)
   and ``torch.autograd.backward(embeddings, cached_grad_slice)`` accumulates its share into
   the parameters' ``.grad``. The RNG stream after the step continues from the end of pass 1.

Parallelism (``model`` is a ``Retriever`` or one wrapped by ``raggedvl.parallel.wrap_model``):

- DDP: every replay but the last runs under ``model.no_sync()``, so the gradient all-reduce
  happens once per optimizer step (in the last replay's backward), over the accumulated
  gradients. Each replay is ONE forward followed by ONE backward, which DDP requires
  (``find_unused_parameters=False``, gradient checkpointing). Ranks may have different
  numbers of chunks: DDP issues no collective in a no-grad or ``no_sync`` forward/backward
  (its one buffer broadcast per step and the bucket rebuild come at the first forward of the
  step on every rank), so no rank waits for another.
- FSDP2: every forward and backward is a collective, so the ranks first agree on the largest
  number of query chunks and of document chunks (two one-element all-reduces through
  :func:`raggedvl.parallel.all_reduce_max`); a rank with fewer runs padding chunks
  (its last chunk of that kind again) whose replay back-propagates an all-zero gradient, an
  exactly zero contribution. ``set_requires_gradient_sync(False)`` replaces ``no_sync``.
  The query chunks are all replayed before the document chunks on every rank, so the ranks
  run their forwards in the same order of kinds. A rank whose documents have no images
  while another's do makes the same calls too: the retriever's dummy vision pass runs the
  tower before the decoder in every chunk (:mod:`raggedvl.models.dummy_vision`).
- A single process (no wrapper): plain accumulation.

Memory: the activations of one chunk, plus what grows with B: the cached embeddings and
their gradients (``[B, D]``, or ``[B, L, D]`` for late interaction; the query gradients are
freed before the document replays) and the loss's own buffers.

Gradient: after the step every trainable parameter holds the same gradient as one forward
and backward of the whole batch through ``loss_fn`` (exact up to floating-point summation
order; with dropout, equal to the whole-batch backward that draws the same masks per chunk).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterator

import torch
from torch import nn

from raggedvl.batch import RaggedBatch
from raggedvl.models import EmbeddingOutput
from raggedvl.parallel import all_reduce_max
from raggedvl.rng import capture_rng_state, replayed_rng_state
from raggedvl.gradcache.chunking import Chunk, chunk_grad, plan_chunks, scatter_embeddings

LossFn = Callable[[EmbeddingOutput, EmbeddingOutput], torch.Tensor]


@dataclass(frozen=True)
class GradCacheStep:
    """What one :func:`grad_cache_step` did: ``loss`` (this rank's loss, detached scalar, as
    ``loss_fn`` returned it), the chunk counts of this rank, the forwards run per kind
    (more than the chunks only for padding chunks under FSDP2) and ``encode_s``, the wall
    seconds of pass 1."""

    loss: torch.Tensor
    query_chunks: int
    doc_chunks: int
    query_forwards: int
    doc_forwards: int
    encode_s: float


def _capture_rng(device: torch.device) -> dict[str, Any]:
    """The RNG state a chunk's forward starts from: CPU, Python and ``device``'s CUDA generator."""
    if device.type == "cuda":
        return capture_rng_state([torch.cuda.current_device() if device.index is None else device.index])
    return capture_rng_state([])


def _is_fsdp2(model: nn.Module) -> bool:
    return callable(getattr(model, "set_requires_gradient_sync", None))


@contextlib.contextmanager
def _gradient_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """DDP ``no_sync`` / FSDP2 ``set_requires_gradient_sync(False)`` unless ``enabled``."""
    if enabled:
        yield
    elif _is_fsdp2(model):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    elif callable(getattr(model, "no_sync", None)):
        with model.no_sync():
            yield
    else:
        yield


def _check_inputs(queries: Any, docs: Any) -> None:
    for name, batch in (("queries", queries), ("docs", docs)):
        if not isinstance(batch, RaggedBatch):
            raise TypeError(f"GradCache needs {name} as a RaggedBatch, got {type(batch).__name__}")
        if batch.num_samples == 0:
            raise ValueError(
                f"GradCache got {name} with 0 samples on this rank; every rank needs >= 1 sample per step "
                "(a rank without a backward would leave the others waiting in the gradient all-reduce)"
            )


def _encode_no_grad(model: nn.Module, chunks: list[Chunk], forwards: int, autocast: ContextManager,
                    device: torch.device) -> tuple[list[EmbeddingOutput], list[dict[str, Any]]]:
    """Pass 1 for one kind: ``forwards`` no-grad forwards (the chunks, then padding repeats of
    the last chunk, whose outputs are discarded)."""
    outputs, states = [], []
    for i in range(forwards):
        chunk = chunks[min(i, len(chunks) - 1)]
        if i < len(chunks):
            states.append(_capture_rng(device))
        with torch.no_grad(), autocast:
            out = model(**chunk.inputs)
        if i < len(chunks):
            outputs.append(out)
    return outputs, states


def grad_cache_step(
    model: nn.Module,
    queries: RaggedBatch,
    docs: RaggedBatch,
    loss_fn: LossFn,
    *,
    budget: int,
    autocast: ContextManager | None = None,
) -> GradCacheStep:
    """Compute ``loss_fn(model(queries), model(docs))`` and accumulate its parameter gradient
    into ``.grad`` chunk by chunk (module docstring). Call ``optimizer.zero_grad()`` before.

    ``model``: a retriever taking ``model(**inputs) -> EmbeddingOutput``, bare, DDP-wrapped or
    FSDP2-sharded. ``queries`` / ``docs``: this rank's ragged batches (on the model's device).
    ``loss_fn(q, d)``: the loss on the assembled :class:`EmbeddingOutput` s (``[B, D]`` or
    ``[B, L, D]`` + mask ``[B, L]``); a cross-rank loss is called once per step on every rank.
    ``budget``: patches + tokens per chunk. ``autocast``: a re-enterable context (e.g.
    ``torch.autocast``) around every forward, or None.

    Collectives: those of ``loss_fn`` (once), of the model wrapper (DDP: one gradient
    all-reduce in the last replay; FSDP2: every forward/backward, plus two one-element
    all-reduce max to agree on chunk counts). Raises ``TypeError`` / ``ValueError`` for a
    non-RaggedBatch input, a rank with no samples or a budget below 1, before any collective.
    """
    _check_inputs(queries, docs)
    autocast = autocast if autocast is not None else contextlib.nullcontext()
    device = queries["input_ids"].device
    plans = {"q": plan_chunks(queries, budget), "d": plan_chunks(docs, budget)}  # checks the budget
    forwards = {k: len(v) for k, v in plans.items()}
    if _is_fsdp2(model):  # every FSDP2 forward is a collective: the same count on every rank
        forwards = {k: int(all_reduce_max(float(n))) for k, n in forwards.items()}

    t0 = time.perf_counter()
    outputs, states = {}, {}
    for kind in ("q", "d"):
        outputs[kind], states[kind] = _encode_no_grad(model, plans[kind], forwards[kind], autocast, device)
    encode_s = time.perf_counter() - t0

    lengths = {"q": queries["input_ids"].shape[-1], "d": docs["input_ids"].shape[-1]}
    cached = {k: scatter_embeddings(outputs[k], plans[k], lengths[k]) for k in ("q", "d")}
    del outputs
    loss = loss_fn(cached["q"], cached["d"])
    loss.backward()
    loss = loss.detach()  # drops the loss graph, whose AccumulateGrad nodes would keep the cache alive
    grads = {k: v.embeddings.grad if v.embeddings.grad is not None else torch.zeros_like(v.embeddings)
             for k, v in cached.items()}
    del cached

    remaining = forwards["q"] + forwards["d"]
    for kind in ("q", "d"):
        grad_all, chunks = grads.pop(kind), plans[kind]  # popped: freed before the next kind's replays
        for i in range(forwards[kind]):
            remaining -= 1
            chunk, state = chunks[min(i, len(chunks) - 1)], states[kind][min(i, len(chunks) - 1)]
            with _gradient_sync(model, enabled=remaining == 0), replayed_rng_state(state):
                with autocast:
                    out = model(**chunk.inputs)
                grad = chunk_grad(grad_all, chunk)
                if i >= len(chunks):  # FSDP2 padding chunk: runs the collectives, contributes exactly zero
                    grad = torch.zeros_like(grad)
                torch.autograd.backward(out.embeddings, grad.to(out.embeddings.dtype))
        del grad_all
    return GradCacheStep(loss, len(plans["q"]), len(plans["d"]), forwards["q"], forwards["d"], encode_s)

"""Cutting a ragged batch into GradCache chunks by a patch + token budget, and moving
embeddings and their gradients between chunks and the whole batch.

Shape legend: B samples of the batch, b samples of a chunk, L token columns of the batch
(padded), Lc token columns kept for a chunk, D embedding dim.

Size of a sample (the budget's unit): the patch rows of its images and videos (sum of t*h*w
over its ``image_grid_thw`` / ``video_grid_thw`` rows, i.e. ``pixel_values`` rows, before the
2x2 merge) plus its tokens (``attention_mask`` ones, placeholders included):
:meth:`RaggedBatch.sample_sizes`. A chunk is a run
of consecutive samples whose sizes sum to at most the budget; a sample larger than the budget
is a chunk of its own. Chunks are cut with :meth:`RaggedBatch.split`, so every image stays with
its sample.

Trailing columns that are padding for every sample of a chunk are dropped before its forward
(with right padding, a chunk of short samples does not pay for the batch's longest one).
Padded keys are masked and causal attention never looks ahead, so a real token's output does
not depend on them. Leading padding columns (left padding) are kept: a text-only Qwen-VL
batch takes its positions from the column index, and the float32 rotary tables would make
the outputs differ at ~1e-7. :func:`scatter_embeddings` puts each chunk's vectors back at
their columns, giving the same ``[B, L, D]`` layout as one forward over the whole batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from raggedvl.batch import RaggedBatch
from raggedvl.models import EmbeddingOutput


@dataclass(frozen=True)
class Chunk:
    """One GradCache chunk of a batch.

    ``rows``: its samples in the batch; ``cols``: the token columns kept (``[0, Lc)``); ``inputs``: the model inputs (``RaggedBatch`` mapping view, per-sample
    tensors narrowed to ``cols``); ``size``: its patches + tokens.
    """

    rows: slice
    cols: slice
    inputs: dict[str, torch.Tensor]
    size: int


def chunk_sizes(sizes: Sequence[int], budget: int) -> list[int]:
    """Samples per chunk: greedy runs of consecutive samples whose sizes sum to <= ``budget``.

    A sample larger than ``budget`` forms a chunk of its own. Returns ``[]`` for no samples;
    otherwise positive counts summing to ``len(sizes)``. Raises ``ValueError`` for a budget
    below 1 or a negative size.
    """
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(f"GradCache chunk budget must be an int >= 1 (patches + tokens per chunk), got {budget!r}")
    out: list[int] = []
    used = 0
    for i, size in enumerate(int(s) for s in sizes):
        if size < 0:
            raise ValueError(f"sample {i} has a negative size {size}; sizes count patches + tokens")
        if out and used + size <= budget:
            out[-1] += 1
            used += size
        else:
            out.append(1)
            used = size
    return out


def _kept_columns(mask_bL: torch.Tensor | None, length: int) -> slice:
    """Columns ``[0, last column any sample uses]`` (all of them without a mask or a used column)."""
    if mask_bL is None:
        return slice(0, length)
    used = mask_bL.detach().bool().any(dim=0).nonzero().flatten()
    return slice(0, int(used[-1]) + 1 if used.numel() else length)


def plan_chunks(batch: RaggedBatch, budget: int) -> list[Chunk]:
    """The batch cut into chunks of at most ``budget`` patches + tokens (module docstring).

    Raises ``ValueError`` for a budget below 1. The chunks' ``rows`` cover ``[0, B)`` in order.
    """
    sizes = batch.sample_sizes()
    counts = chunk_sizes(sizes.tolist(), budget)
    length = batch["input_ids"].shape[-1]
    sample_keys = batch.layout.sample_dims
    chunks, start = [], 0
    for part, n in zip(batch.split(counts), counts):
        cols = _kept_columns(part.get("attention_mask"), length)
        inputs = {
            k: v[..., cols] if k in sample_keys else v for k, v in part.items()
        }  # every per-sample tensor has its token dim last ([B, L], position_ids [3|4, B, L])
        chunks.append(Chunk(slice(start, start + n), cols, inputs, int(sizes[start:start + n].sum())))
        start += n
    return chunks


def scatter_embeddings(outputs: Sequence[EmbeddingOutput], chunks: Sequence[Chunk], length: int) -> EmbeddingOutput:
    """The chunks' outputs as one batch output whose ``embeddings`` is a new leaf tensor with
    ``requires_grad=True`` (the GradCache cache; no graph to the model).

    Bi-encoder outputs (``[b, D]``, mask None) are concatenated to ``[B, D]``; multi-vector
    outputs (``[b, Lc, D]`` with mask ``[b, Lc]``) are placed at their chunk's rows and columns of
    a zero ``[B, L, D]`` tensor with a False-padded mask ``[B, L]`` (``length`` = L).
    Raises ``ValueError`` when outputs mix the two kinds or a chunk's output has the wrong shape.
    """
    kinds = {out.mask is None for out in outputs}
    if len(kinds) != 1:
        raise ValueError("chunk outputs mix bi-encoder ([b, D]) and multi-vector ([b, L, D]) embeddings")
    num_samples = chunks[-1].rows.stop
    first = outputs[0].embeddings
    if kinds == {True}:
        emb = torch.cat([out.embeddings.detach() for out in outputs])
        return EmbeddingOutput(emb.requires_grad_(True), None)
    emb_BLD = first.new_zeros(num_samples, length, first.shape[-1])
    mask_BL = torch.zeros(num_samples, length, dtype=torch.bool, device=first.device)
    for out, chunk in zip(outputs, chunks):
        want = (chunk.rows.stop - chunk.rows.start, chunk.cols.stop - chunk.cols.start)
        if tuple(out.embeddings.shape[:2]) != want:
            raise ValueError(
                f"chunk of samples {chunk.rows.start}..{chunk.rows.stop - 1} returned embeddings "
                f"{tuple(out.embeddings.shape)}, expected [{want[0]}, {want[1]}, D] (one vector per input token)"
            )
        emb_BLD[chunk.rows, chunk.cols] = out.embeddings.detach()
        mask_BL[chunk.rows, chunk.cols] = out.mask
    return EmbeddingOutput(emb_BLD.requires_grad_(True), mask_BL)


def chunk_grad(grad: torch.Tensor, chunk: Chunk) -> torch.Tensor:
    """The slice of the batch's embedding gradient (``[B, D]`` or ``[B, L, D]``) that belongs
    to ``chunk``'s own output (``[b, D]`` or ``[b, Lc, D]``), contiguous."""
    if grad.dim() == 2:
        return grad[chunk.rows].contiguous()
    return grad[chunk.rows, chunk.cols].contiguous()

"""mteb runs a raggedvl retriever: :class:`MtebEncoder` is an ``mteb.models.AbsEncoder`` over a
:class:`raggedvl.models.Retriever`, so ``mteb.evaluate`` scores it on any mteb retrieval task
(ViDoRe v1 / v2 / v3: text queries, page images) with the prompts the retriever was trained
with, whatever instruction the task's metadata carries.

Shape legend: n inputs, L_max the longest item's vectors, D embedding dim, Q queries, C documents.

Embeddings come from :func:`raggedvl.evaluation.encode.encode_queries` /
:func:`~raggedvl.evaluation.encode.encode_documents` (size-bucketed batches, the retriever's
collator: its ``RetrievalPrompts``, family and processor), as ``raggedvl eval`` computes them.
A multi-vector head's items come back as one float32 tensor ``[n, L_max, D]`` whose padding
vectors are NaN, and :meth:`MtebEncoder.similarity` scores MaxSim with those positions masked
(:func:`raggedvl.evaluation.search.score_chunk`), the score ``raggedvl eval`` ranks by. Zero
padding would not be the same: a zero vector's dot product 0 beats every real vector of a query
whose similarities are all negative. NaN padding also makes a scorer that does not mask (mteb's
own ``max_sim``) return NaN, which mteb rejects, instead of a silently different score. A
bi-encoder's items are ``[n, D]`` and score by dot product.

mteb ranks equal scores by document id, descending (as trec_eval and ``raggedvl eval`` do), and
computes nDCG / MAP with pytrec_eval: on the same data its numbers are ``raggedvl eval``'s.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from mteb.models import ModelMeta
from mteb.models.abs_encoder import AbsEncoder
from mteb.models.model_meta import ScoringFunction
from mteb.types import PromptType

from raggedvl.evaluation.encode import encode_documents, encode_queries, model_collator
from raggedvl.evaluation.search import pad_rows, score_chunk


def nan_padded(rows: list[torch.Tensor]) -> torch.Tensor:
    """Ragged ``[L_i, D]`` rows as ``[n, L_max, D]`` float32 with NaN padding vectors, or
    single ``[D]`` vectors stacked ``[n, D]``."""
    if rows[0].ndim == 1:
        return torch.stack(rows).float()
    emb, mask = pad_rows(rows)
    return emb.masked_fill(~mask[..., None], math.nan)


def unpadded(embeddings: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(float32 embeddings with padding zeroed, bool mask ``[n, L_max]``) of :func:`nan_padded`
    output, or (``[n, D]``, None) for single vectors."""
    emb = torch.as_tensor(embeddings).float()
    if emb.ndim == 2:
        return emb, None
    mask = ~torch.isnan(emb).any(dim=-1)
    return emb.nan_to_num(0.0), mask


class MtebEncoder(AbsEncoder):
    """An mteb encoder for a raggedvl retriever (module docstring).

    Args:
        model: a :class:`raggedvl.models.Retriever` (``build_retriever``, or a training run's
            retriever as ``raggedvl eval`` loads it), on the device it should run on.
        processor: its processor (default: the one ``build_retriever`` attached).
        collator: the :class:`raggedvl.data.RetrievalCollator` writing its inputs (default:
            :func:`raggedvl.evaluation.encode.model_collator`: the retriever's prompts and
            family); pass one to set ``max_length`` as the run trained with.
        name: the model's name in mteb's results ("organisation/model"; with ``revision`` it
            keys mteb's results cache: give each checkpoint its own, or evaluate with
            ``cache=None``).
        revision: e.g. the training step.
        progress: show encoding progress on stderr (:func:`raggedvl.evaluation.encode.progress_calls`).

    Raises ``ValueError`` when the retriever has no processor."""

    def __init__(self, model: torch.nn.Module, processor: Any = None, *, collator: Any = None,
                 name: str = "raggedvl/retriever", revision: str | None = None, progress: bool = False) -> None:
        self.model, self.progress = model, progress
        self.collator = collator if collator is not None else model_collator(model, processor)
        multi = model.config.head != "bi_encoder"
        self.mteb_model_meta = ModelMeta.create_empty(overwrites={
            "name": name, "revision": revision, "modalities": ["image", "text"], "framework": ["PyTorch"],
            "model_type": ["late-interaction" if multi else "dense"], "embed_dim": model.config.dim,
            "similarity_fn_name": ScoringFunction.MAX_SIM if multi else ScoringFunction.DOT_PRODUCT,
            "n_parameters": sum(p.numel() for p in model.parameters()), "use_instructions": False,
        })

    def encode(self, inputs, *, task_metadata, hf_split: str, hf_subset: str, prompt_type: PromptType | None = None,
               **kwargs: Any) -> torch.Tensor:
        """Embeddings of mteb's ``inputs`` (a DataLoader of ``{"text": [...]}`` query batches or
        ``{"image": [PIL images]}`` document batches), in order: ``[n, L_max, D]`` NaN-padded
        or ``[n, D]`` (module docstring). ``kwargs["batch_size"]``: items per forward pass
        (mteb's ``encode_kwargs``). Raises ``ValueError`` for documents without images (a
        raggedvl retriever embeds page images) or queries without text."""
        device = next(self.model.parameters()).device
        batch_size = int(kwargs.get("batch_size") or 16)
        if prompt_type is None:
            column = "image" if "image" in inputs.dataset.column_names else "text"
        else:
            column = "text" if prompt_type == PromptType.query else "image"
        items = []
        for batch in inputs:
            values = batch.get(column)
            if values is None or any(v is None for v in values):
                kind = "queries" if column == "text" else "documents"
                raise ValueError(f"mteb task {task_metadata.name} ({hf_subset}/{hf_split}): {kind} without {column!r}: "
                                 f"a raggedvl retriever embeds text queries and page-image documents")
            items.extend(values)
        if not items:
            raise ValueError(f"mteb task {task_metadata.name} ({hf_subset}/{hf_split}): nothing to encode")
        with torch.no_grad():
            if column == "text":
                rows = encode_queries(self.model, self.collator, items, batch_size=batch_size, device=device,
                                      progress=self.progress)
            else:
                rows = encode_documents(self.model, self.collator, items, batch_size=batch_size, device=device,
                                        progress=self.progress)
        rows = list(rows)
        bad = next((i for i, r in enumerate(rows) if torch.isnan(r).any()), None)
        if bad is not None:
            raise ValueError(f"mteb task {task_metadata.name}: the retriever's embedding of item {bad} holds NaN "
                             f"(a diverged checkpoint?); NaN marks padding here and cannot be scored")
        return nan_padded(rows)

    def similarity(self, embeddings1: Any, embeddings2: Any) -> torch.Tensor:
        """``[Q, C]`` scores of queries ``embeddings1`` against documents ``embeddings2`` (both
        :meth:`encode` output): MaxSim with padding masked, or dot products."""
        q, q_mask = unpadded(embeddings1)
        d, d_mask = unpadded(embeddings2)
        return score_chunk(q, q_mask, d, d_mask)

    def similarity_pairwise(self, embeddings1: Any, embeddings2: Any) -> torch.Tensor:
        """``[n]`` scores of item i of ``embeddings1`` against item i of ``embeddings2``."""
        return torch.stack([self.similarity(a[None], b[None])[0, 0]
                            for a, b in zip(torch.as_tensor(embeddings1), torch.as_tensor(embeddings2))])

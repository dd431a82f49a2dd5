"""One call signature for every retrieval loss: ``loss(queries, docs, negatives=None) -> L_r``.

``queries``, ``docs`` and ``negatives`` are embedding outputs: anything with ``.embeddings`` and
``.mask`` (:class:`raggedvl.models.EmbeddingOutput`). Multi-vector losses
(``late_interaction``, ``pairwise``) take ``embeddings [n, L, D]`` with a bool ``mask [n, L]``;
``infonce`` takes single vectors ``[n, D]`` (mask ``None``). ``negatives`` holds k hard
negatives per query, query-major (``[n*k, ...]``). The value, the collectives and the gradient
are those of the wrapped loss module (:mod:`raggedvl.losses.modules`): this rank's share
``L_r = (W/N) * sum`` of its per-query terms, with positives and negatives gathered from every
rank.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import torch
from torch import nn

from raggedvl.losses.modules import InfoNCELoss, LateInteractionLoss, PairwiseLoss

LOSS_NAMES = ("late_interaction", "pairwise", "infonce")


class Embeddings(Protocol):
    """What the losses read from a model output (``raggedvl.models.EmbeddingOutput``)."""

    embeddings: torch.Tensor
    mask: torch.Tensor | None


class RetrievalLoss(nn.Module):
    """A raggedvl loss module called on embedding outputs: ``forward(queries, docs,
    negatives=None, **kwargs) -> L_r`` (0-dim); ``kwargs`` go to the wrapped module.

    The wrapped module is ``self.loss`` (its parameters, e.g. a learnable logit scale, are this
    module's). Raises ``TypeError`` for a module that is not a raggedvl loss, and ``ValueError``
    (before any collective) when a multi-vector loss is given single-vector outputs.
    """

    def __init__(self, loss: InfoNCELoss | LateInteractionLoss | PairwiseLoss) -> None:
        super().__init__()
        if not isinstance(loss, (InfoNCELoss, LateInteractionLoss, PairwiseLoss)):
            raise TypeError(f"expected a raggedvl InfoNCELoss, LateInteractionLoss or PairwiseLoss, got {type(loss).__name__}")
        self.loss = loss
        self.multi_vector = not isinstance(loss, InfoNCELoss)

    def forward(self, queries: Embeddings, docs: Embeddings, negatives: Embeddings | None = None,
                **kwargs: Any) -> torch.Tensor:
        if not self.multi_vector:
            neg = None if negatives is None else negatives.embeddings
            return self.loss(queries.embeddings, docs.embeddings, neg, **kwargs)
        for name, out in (("queries", queries), ("docs", docs), ("negatives", negatives)):
            if out is not None and out.mask is None:
                raise ValueError(
                    f"{type(self.loss).__name__} needs multi-vector {name} (embeddings [n, L, D] with a mask); got "
                    f"single vectors of shape {list(out.embeddings.shape)}: use loss 'infonce' with a bi-encoder head"
                )
        neg = (None, None) if negatives is None else (negatives.embeddings, negatives.mask)
        return self.loss(queries.embeddings, queries.mask, docs.embeddings, docs.mask, *neg, **kwargs)


def _rows(out: Any, rows: slice) -> Any:
    mask = None if out.mask is None else out.mask[rows]
    return dataclasses.replace(out, embeddings=out.embeddings[rows], mask=mask)


def loss_with_negatives(loss: RetrievalLoss, queries: Embeddings, docs: Embeddings, num_positives: int,
                        **kwargs: Any) -> torch.Tensor:
    """``loss(queries, positives, negatives)`` where ``docs`` is ONE document encode holding the
    ``num_positives`` positives (rows ``[0, n)``) then the hard negatives (rows ``[n, n + n*k)``,
    query-major), as ``RetrievalCollator`` returns them (``docs`` then ``negatives``) and a
    training step encodes them in one forward call. ``docs``: an embedding output (a dataclass
    with ``embeddings [n + n*k, ...]`` and ``mask [n + n*k, L]`` or None); the slices keep the
    shared padding (masked). Value, collectives and gradient: those of ``loss`` (the hard-negative
    path of :mod:`raggedvl.losses.modules`); the gradient flows to both slices of ``docs``.
    Raises ``ValueError`` when ``num_positives`` is outside ``[0, rows]`` (and whatever ``loss`` raises)."""
    total = docs.embeddings.shape[0]
    if not 0 <= num_positives <= total:
        raise ValueError(f"num_positives {num_positives} is outside [0, {total}], the rows of the document encode")
    if num_positives == total:
        return loss(queries, docs, **kwargs)
    return loss(queries, _rows(docs, slice(0, num_positives)), _rows(docs, slice(num_positives, total)), **kwargs)


def make_retrieval_loss(name: str = "late_interaction", *, temperature: float = 0.02, **options: Any) -> RetrievalLoss:
    """The loss called ``name`` on embedding outputs.

    ``name``: ``"late_interaction"`` (:class:`LateInteractionLoss`), ``"pairwise"``
    (:class:`PairwiseLoss`; it has no temperature: ``temperature`` is not used) or ``"infonce"``
    (:class:`InfoNCELoss`). ``temperature`` divides the scores (logits = score / temperature).
    ``options`` go to the loss class (``gather_across_ranks``, ``group``, ``symmetric``, ...).
    Raises ``ValueError`` for an unknown name (and whatever the loss class raises).
    """
    if name == "infonce":
        return RetrievalLoss(InfoNCELoss(temperature=temperature, **options))
    if name == "late_interaction":
        return RetrievalLoss(LateInteractionLoss(temperature=temperature, **options))
    if name == "pairwise":
        return RetrievalLoss(PairwiseLoss(**options))
    raise ValueError(f"unknown loss {name!r}; choose one of {LOSS_NAMES}")

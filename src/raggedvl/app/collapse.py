"""Collapse check of ``raggedvl train``: the loss sits at its chance value.

A contrastive retriever has collapsed when every document embeds to the same vectors: then every
query scores every candidate the same, and the loss of each query is exactly its value at equal
scores, the chance loss:

- ``late_interaction`` and ``infonce`` (cross-entropy of each query over the candidates it
  competes against: the N positives of the step's global batch plus its M hard negatives, all
  ranks' together): ``ln(N + M)`` (log-sum-exp of N + M equal logits minus one of them), so
  ``ln(global batch)`` only without hard negatives and for a full step;
- ``pairwise`` (``softplus(hardest negative - positive)``): ``softplus(0) = ln 2`` whatever N and M.

The chance value is taken per step (``CollapseCheck.update(..., chance=)``): the last step of an
epoch can be smaller, and ``on_bad_image="skip"`` drops pairs with their negatives.

The training loss is the global mean over ranks, the same float on every rank, so every rank
reaches the same verdict with no extra collective and a stop never leaves a rank waiting. The
check is a streak: the loss within ``tolerance`` (absolute) of the chance value for
``patience`` steps in a row. A healthy run starts near chance (random embeddings score about
alike) but moves by far more than 1e-4 from step to step; a collapsed one stays there to
within float rounding (its gradient is ~0). Mean pairwise cosine of documents' mean-pooled
embeddings (``raggedvl.evaluation.mean_pairwise_cosine``), when the caller passes it, is
reported beside the verdict: it reads 1.0000 for a collapsed model.

After training, the same statistic over an evaluation set's documents is the one criterion
that the run summary (``summary.md``) and ``raggedvl eval`` both apply
(:func:`doc_cosine_warning`): above ``COLLAPSED_DOC_COSINE`` (0.999) the documents count as
collapsed. A healthy tiny model reads 0.96-0.999 on mostly white pages, a collapsed one
0.9999-1.0000 (docs/tiny-model.md); 0.999 flags the band between as well.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from raggedvl.app.wording import counted

LIKELY_CAUSES = (
    "learning rate too high for this model and batch (try a 2-5x lower --lr, or a 10x higher --head-lr than --lr), "
    "a query prefix shared by every query (--query-prefix; it gives each document the same score term for every "
    "query: BENCHMARKS.md, loss curves against colpali-engine), a randomly initialised or untrained backbone (see docs/tiny-model.md), "
    "a --temperature too low for its scores, or documents that are nearly identical (blank pages)"
)


COLLAPSED_DOC_COSINE = 0.999  # documents' mean pairwise cosine above which they count as collapsed


def doc_cosine_warning(doc_cosine: float | None) -> str | None:
    """The one-line warning for documents whose mean pairwise cosine (mean-pooled embeddings,
    ``raggedvl.evaluation.mean_pairwise_cosine``) is above ``COLLAPSED_DOC_COSINE``; None at or
    below it, and for None or NaN (fewer than two documents)."""
    if doc_cosine is None or math.isnan(doc_cosine) or not doc_cosine > COLLAPSED_DOC_COSINE:
        return None
    return (f"WARNING: document embeddings have collapsed: their mean pairwise cosine {doc_cosine:.4f} is above "
            f"{COLLAPSED_DOC_COSINE} (every page embeds to nearly the same vector, so every query scores them alike)")


def chance_loss(loss: str, global_batch: int, hard_negatives: int = 0) -> float:
    """The loss value at equal scores for every candidate (module docstring): ``ln(N + M)`` for
    ``late_interaction`` and ``infonce`` with ``global_batch`` = N pairs (in-batch candidates)
    and ``hard_negatives`` = M hard negatives in the step (all ranks), ``ln 2`` for
    ``pairwise``. Raises ``ValueError`` for an unknown loss, ``global_batch < 1`` or
    ``hard_negatives < 0``."""
    if global_batch < 1:
        raise ValueError(f"global_batch must be >= 1, got {global_batch}")
    if hard_negatives < 0:
        raise ValueError(f"hard_negatives must be >= 0, got {hard_negatives}")
    if loss in ("late_interaction", "infonce"):
        return math.log(global_batch + hard_negatives)
    if loss == "pairwise":
        return math.log(2.0)
    raise ValueError(f"unknown loss {loss!r}; choose late_interaction, pairwise or infonce")


@dataclass
class CollapseCheck:
    """Streak counter: ``update(step, loss, chance=...)`` returns a one-line warning the first
    time the loss has been within ``tolerance`` of that step's chance value for ``patience``
    steps in a row, else None (``patience`` 0: never). ``chance`` passed to ``update`` replaces
    ``self.chance`` (the constructor's is the value of a full step without hard negatives, used
    while no step passes one), so ``self.chance`` is the latest step's value, and once the check
    has fired, the value of the step it fired at. ``fired``
    stays True once it has fired (one warning per run); a loss that leaves the chance value
    resets the streak. ``doc_cosine`` (optional) is added to the message."""

    chance: float
    patience: int
    tolerance: float = 1e-4
    streak: int = 0
    fired: bool = False

    def update(self, step: int, loss: float, doc_cosine: float | None = None, chance: float | None = None) -> str | None:
        if self.patience <= 0 or self.fired:
            return None
        if chance is not None:
            self.chance = chance
        self.streak = self.streak + 1 if abs(loss - self.chance) <= self.tolerance else 0
        if self.streak < self.patience:
            return None
        self.fired = True
        cos = "" if doc_cosine is None or math.isnan(doc_cosine) else f", documents' mean pairwise cosine {doc_cosine:.4f}"
        return (
            f"raggedvl: training collapsed at step {step}: the loss has been its chance value {self.chance:.4f} "
            f"(every document scores the same) for {counted(self.patience, 'step')}{cos}; likely causes: {LIKELY_CAUSES}"
        )

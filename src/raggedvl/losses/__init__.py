"""raggedvl.losses: exact cross-rank contrastive losses for visual retrievers.

Pure math lives in :mod:`raggedvl.losses.functional` (targets from gathered counts, per-query
terms, the ``(W/N) * sum`` scaling) and :mod:`raggedvl.losses.scoring` (blocked MaxSim); the
``nn.Module`` wrappers in :mod:`raggedvl.losses.modules` gather embeddings across ranks with
:mod:`raggedvl.parallel.gather` and return this rank's share ``L_r`` of the global mean loss;
:func:`make_retrieval_loss` (:mod:`raggedvl.losses.objective`) builds one by name, called on
the model's embedding outputs: ``loss(queries, docs, negatives=None)``.

Gradient accumulation: a loss sees only the embeddings of the call it is given. With g
micro-batches per optimizer step, each micro-batch's queries are contrasted against the
positives and hard negatives of *its own global micro-batch* (the micro-batch of every rank,
gathered), not against the other g-1 micro-batches; accumulating the g gradients (each loss
divided by g) gives the average of g smaller-batch losses, which is a different objective from
one loss over the whole step's batch. To contrast every query against the full step's global
batch without holding its activations, use GradCache (``raggedvl.gradcache``): it embeds all
micro-batches without graphs, calls one of these losses once on the full global batch, and
replays each micro-batch's backward with the cached embedding gradients.
"""

from raggedvl.losses.functional import (
    cross_entropy_terms,
    document_false_negative_mask,
    false_negative_mask,
    global_mean_share,
    pairwise_terms,
    positive_labels,
    real_rows,
)
from raggedvl.losses.modules import InfoNCELoss, LateInteractionLoss, PairwiseLoss
from raggedvl.losses.objective import LOSS_NAMES, RetrievalLoss, loss_with_negatives, make_retrieval_loss
from raggedvl.losses.scoring import check_late_interaction_inputs, late_interaction_scores

__all__ = [
    "LOSS_NAMES",
    "InfoNCELoss",
    "LateInteractionLoss",
    "PairwiseLoss",
    "RetrievalLoss",
    "check_late_interaction_inputs",
    "cross_entropy_terms",
    "document_false_negative_mask",
    "false_negative_mask",
    "global_mean_share",
    "late_interaction_scores",
    "loss_with_negatives",
    "make_retrieval_loss",
    "pairwise_terms",
    "positive_labels",
    "real_rows",
]

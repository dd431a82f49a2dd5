"""raggedvl.gradcache: GradCache for ragged retrieval batches (library code: ``raggedvl train``
and ``raggedvl.hf.RaggedTrainer`` users both call it).

:func:`grad_cache_step` runs one step's forward and backward with the contrastive loss over a
rank's whole batch (and, through the loss's gather, the global batch) while holding the
activations of one chunk only (:mod:`raggedvl.gradcache.step`); :func:`plan_chunks` cuts a
:class:`~raggedvl.batch.RaggedBatch` into chunks of at most ``budget`` patches + tokens
(:mod:`raggedvl.gradcache.chunking`).
"""

from raggedvl.gradcache.chunking import Chunk, chunk_sizes, plan_chunks
from raggedvl.gradcache.step import GradCacheStep, grad_cache_step

__all__ = ["Chunk", "GradCacheStep", "chunk_sizes", "grad_cache_step", "plan_chunks"]

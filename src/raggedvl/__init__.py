"""raggedvl: correct and fast data-parallel training of dynamic-resolution vision-language models.

Public API (imported lazily, so ``import raggedvl`` stays cheap):

- ``RaggedBatch``: Qwen2-VL / Qwen2.5-VL / Qwen3-VL batches that split, select, concatenate
  and pad exactly (``raggedvl.batch``);
- ``RaggedDataParallel``, ``scatter_batch``: whole-sample DataParallel (``raggedvl.parallel``);
- ``InfoNCELoss``, ``LateInteractionLoss``, ``PairwiseLoss``, ``late_interaction_scores``:
  exact cross-rank contrastive losses (``raggedvl.losses``);
- ``BalancedDistributedBatchSampler``, ``estimate_costs``: cost-balanced sharding from image
  headers (``raggedvl.sampling``);
- ``grad_cache_step``: GradCache over ragged batches, the whole global batch's contrastive loss
  with one chunk's activation memory (``raggedvl.gradcache``);
- ``ImagePolicy``: what every image becomes before the processor, for the size estimate and
  the collators alike (``raggedvl.images``);
- ``build_retriever``, ``build_processor``, ``RetrievalCollator``, ``build_rdocs``: model and
  data building blocks of ``raggedvl train`` (``raggedvl.models``, ``raggedvl.data``);
  ``build_retriever`` also loads colpali-engine and transformers ColQwen2 checkpoints
  (``raggedvl.models.interop``); ``RetrievalPrompts``: how a retriever's inputs are written;
- ``embed_queries``, ``embed_documents``: a retriever's embeddings of query texts and page
  images, size-bucketed, in input order (``raggedvl.evaluation.encode``);
- ``load_benchmark``, ``evaluate_benchmark``, ``score_metrics``, ``search``,
  ``EmbeddingIndex``: evaluation as the field reports it and exact chunked search
  (``raggedvl.evaluation``).
"""

from __future__ import annotations

from raggedvl.lazy import lazy_exports

__version__ = "0.1.0"

_EXPORTS = {
    "RaggedBatch": "raggedvl.batch",
    "CostModel": "raggedvl.batch",
    "RaggedDataParallel": "raggedvl.parallel",
    "scatter_batch": "raggedvl.parallel",
    "gather_outputs": "raggedvl.parallel",
    "all_gather_variable": "raggedvl.parallel",
    "all_gather_padded": "raggedvl.parallel",
    "init_distributed": "raggedvl.parallel",
    "prepare_ragged_data_loader": "raggedvl.parallel",
    "real_sample_count": "raggedvl.parallel",
    "real_sample_mask": "raggedvl.parallel",
    "InfoNCELoss": "raggedvl.losses",
    "LateInteractionLoss": "raggedvl.losses",
    "PairwiseLoss": "raggedvl.losses",
    "late_interaction_scores": "raggedvl.losses",
    "grad_cache_step": "raggedvl.gradcache",
    "BalancedDistributedBatchSampler": "raggedvl.sampling",
    "estimate_costs": "raggedvl.sampling",
    "ImagePolicy": "raggedvl.images",
    "BadImageError": "raggedvl.images",
    "build_retriever": "raggedvl.models",
    "Retriever": "raggedvl.models",
    "build_processor": "raggedvl.data",
    "build_rdocs": "raggedvl.data",
    "RetrievalCollator": "raggedvl.data",
    "RetrievalPrompts": "raggedvl.prompts",
    "load_retrieval_dataset": "raggedvl.data",
    "embed_queries": "raggedvl.evaluation.encode",
    "embed_documents": "raggedvl.evaluation.encode",
    "load_benchmark": "raggedvl.evaluation.benchmark",
    "RetrievalBenchmark": "raggedvl.evaluation.benchmark",
    "evaluate_benchmark": "raggedvl.evaluation.evaluator",
    "score_metrics": "raggedvl.evaluation",
    "search": "raggedvl.evaluation.search",
    "EmbeddingIndex": "raggedvl.evaluation.index",
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())

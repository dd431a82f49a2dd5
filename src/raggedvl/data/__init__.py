"""raggedvl.data: the embedded rdocs dataset, retrieval datasets and loaders, processors, collator
(image hardening: ``raggedvl.images``, re-exported here).

Names are imported lazily (PEP 562), so that ``raggedvl.data.scan`` (the launcher's data check)
and ``raggedvl.data.dataset`` load without transformers or torch."""

from __future__ import annotations

from raggedvl.lazy import lazy_exports

_EXPORTS = {
    "BadImageError": "raggedvl.images",
    "DEFAULT_JOB_DEV_PAIRS": "raggedvl.data.rdocs",
    "DEFAULT_JOB_TRAIN_PAIRS": "raggedvl.data.rdocs",
    "DOC_TEMPLATE": "raggedvl.data.collator",
    "IMAGE_BLOCK": "raggedvl.data.collator",
    "ImagePolicy": "raggedvl.images",
    "QUERY_AUGMENTATION": "raggedvl.data.collator",
    "QUERY_TEMPLATE": "raggedvl.data.collator",
    "QWEN2_VL_SPECIAL_TOKENS": "raggedvl.data.processing",
    "Qwen2VLImageTextProcessor": "raggedvl.data.processing",
    "RetrievalCollator": "raggedvl.data.collator",
    "RetrievalDataset": "raggedvl.data.dataset",
    "TINY_MAX_PIXELS": "raggedvl.data.tiny_limits",
    "TINY_MIN_PIXELS": "raggedvl.data.tiny_limits",
    "build_processor": "raggedvl.data.processing",
    "build_rdocs": "raggedvl.data.rdocs",
    "ColumnError": "raggedvl.data.columns",
    "DataSource": "raggedvl.data.source",
    "Columns": "raggedvl.data.columns",
    "build_tiny_tokenizer": "raggedvl.data.processing",
    "cache_root": "raggedvl.data.cache",
    "load_image": "raggedvl.images",
    "load_retrieval_dataset": "raggedvl.data.dataset",
    "set_pixel_limits": "raggedvl.data.processing",
    "verify_manuals": "raggedvl.data.rdocs",
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())

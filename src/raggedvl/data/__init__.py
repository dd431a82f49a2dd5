"""raggedvl.data: the embedded rdocs dataset, retrieval datasets and loaders, processors, collator
(image hardening: ``raggedvl.images``, re-exported here)."""

from .collator import DOC_TEMPLATE, IMAGE_BLOCK, QUERY_AUGMENTATION, QUERY_TEMPLATE, RetrievalCollator
from .dataset import RetrievalDataset, load_retrieval_dataset
from raggedvl.images import BadImageError, ImagePolicy, load_image

from .processing import (
    QWEN2_VL_SPECIAL_TOKENS,
    TINY_MAX_PIXELS,
    TINY_MIN_PIXELS,
    Qwen2VLImageTextProcessor,
    build_processor,
    build_tiny_tokenizer,
    set_pixel_limits,
)
from .cache import cache_root
from .rdocs import DEFAULT_JOB_DEV_PAIRS, DEFAULT_JOB_TRAIN_PAIRS, build_rdocs, verify_manuals

__all__ = [
    "BadImageError",
    "DEFAULT_JOB_DEV_PAIRS",
    "DEFAULT_JOB_TRAIN_PAIRS",
    "DOC_TEMPLATE",
    "IMAGE_BLOCK",
    "ImagePolicy",
    "QUERY_AUGMENTATION",
    "QUERY_TEMPLATE",
    "QWEN2_VL_SPECIAL_TOKENS",
    "Qwen2VLImageTextProcessor",
    "RetrievalCollator",
    "RetrievalDataset",
    "TINY_MAX_PIXELS",
    "TINY_MIN_PIXELS",
    "build_processor",
    "build_rdocs",
    "build_tiny_tokenizer",
    "cache_root",
    "load_image",
    "load_retrieval_dataset",
    "set_pixel_limits",
    "verify_manuals",
]

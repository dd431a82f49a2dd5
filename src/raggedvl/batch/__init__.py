"""raggedvl.batch: the ragged batch type, per-family layouts, validation, padding interop, costs."""

from .costs import CostModel
from .layouts import LAYOUTS, BatchLayout, TokenIds, VisualStream, get_layout
from .offsets import exclusive_cumsum
from .padded import pad_patches, unpad_patches
from .ragged import RaggedBatch

__all__ = [
    "LAYOUTS",
    "BatchLayout",
    "CostModel",
    "RaggedBatch",
    "TokenIds",
    "VisualStream",
    "exclusive_cumsum",
    "get_layout",
    "pad_patches",
    "unpad_patches",
]

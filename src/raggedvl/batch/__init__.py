"""raggedvl.batch: the ragged batch type, validation, padding interop, costs (the per-family
layouts live in the family registry, ``raggedvl.families``; re-exported here)."""

from raggedvl.families import BatchLayout, TokenIds, VisualStream, get_layout

from .costs import CostModel
from .offsets import exclusive_cumsum
from .padded import pad_patches, unpad_patches
from .ragged import RaggedBatch

__all__ = [
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

"""Checkpoints of other libraries: colpali-engine (ColQwen2 / ColQwen2.5, full or LoRA adapter)
and transformers' ``ColQwen2ForRetrieval``, loaded as a :class:`~raggedvl.models.Retriever`
(``build_retriever`` dispatches here).

The weights map by renaming (``backbone.<name>`` <-> colpali's ``<name>`` / transformers'
``vlm.<name>``; ``head.proj`` <-> ``custom_text_proj`` / ``embedding_proj_layer``) and the
prompts travel with the model (``RetrieverConfig.prompts``), so the same inputs give the same
token ids and embeddings as the source library.
"""

from .colpali import apply_adapter, load_colpali
from .detect import KINDS, checkpoint_kind
from .hf_colqwen2 import load_hf_colqwen2, mrope_position_ids
from .load import check_checkpoint, load_checkpoint

__all__ = [
    "KINDS",
    "apply_adapter",
    "check_checkpoint",
    "checkpoint_kind",
    "load_checkpoint",
    "load_colpali",
    "load_hf_colqwen2",
    "mrope_position_ids",
]

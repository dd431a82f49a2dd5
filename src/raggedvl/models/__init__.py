"""raggedvl.models: ColQwen-style and bi-encoder retrievers over Qwen-VL backbones."""

from raggedvl.families import FAMILIES, Family, family_of

from .attention import resolve_attn_implementation
from .build import build_retriever, load_backbone
from .dummy_vision import (
    dummy_vision_inputs,
    dummy_vision_term,
    install_dummy_vision,
    missing_modalities,
    vision_base_model,
)
from .tiny import TinySizes, special_token_ids, tiny_backbone_config
from .heads import EmbeddingOutput, RetrievalHead, pool_hidden
from .lora import LoraSettings, apply_generation_lora, apply_lora
from .patch_embed import WholePatchConv3d, install_linear_patch_embed
from .retriever import Retriever, RetrieverConfig

__all__ = [
    "FAMILIES",
    "EmbeddingOutput",
    "Family",
    "LoraSettings",
    "RetrievalHead",
    "Retriever",
    "RetrieverConfig",
    "TinySizes",
    "WholePatchConv3d",
    "apply_generation_lora",
    "apply_lora",
    "build_retriever",
    "dummy_vision_inputs",
    "dummy_vision_term",
    "family_of",
    "install_dummy_vision",
    "install_linear_patch_embed",
    "load_backbone",
    "missing_modalities",
    "pool_hidden",
    "resolve_attn_implementation",
    "special_token_ids",
    "tiny_backbone_config",
    "vision_base_model",
]

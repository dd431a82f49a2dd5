"""raggedvl.models: ColQwen-style and bi-encoder retrievers over Qwen-VL backbones.

Names are imported lazily (PEP 562), so ``raggedvl.models.head_options`` reads without torch."""

from __future__ import annotations

from raggedvl.lazy import lazy_exports

_EXPORTS = {
    "FAMILIES": "raggedvl.families",
    "Family": "raggedvl.families",
    "family_of": "raggedvl.families",
    "resolve_attn_implementation": "raggedvl.models.attention",
    "build_retriever": "raggedvl.models.build",
    "load_backbone": "raggedvl.models.build",
    "dummy_vision_inputs": "raggedvl.models.dummy_vision",
    "dummy_vision_term": "raggedvl.models.dummy_vision",
    "install_dummy_vision": "raggedvl.models.dummy_vision",
    "missing_modalities": "raggedvl.models.dummy_vision",
    "vision_base_model": "raggedvl.models.dummy_vision",
    "TinySizes": "raggedvl.models.tiny",
    "special_token_ids": "raggedvl.models.tiny",
    "tiny_backbone_config": "raggedvl.models.tiny",
    "EmbeddingOutput": "raggedvl.models.heads",
    "RetrievalHead": "raggedvl.models.heads",
    "pool_hidden": "raggedvl.models.heads",
    "LoraSettings": "raggedvl.models.lora",
    "apply_generation_lora": "raggedvl.models.lora",
    "apply_lora": "raggedvl.models.lora",
    "WholePatchConv3d": "raggedvl.models.patch_embed",
    "install_linear_patch_embed": "raggedvl.models.patch_embed",
    "Retriever": "raggedvl.models.retriever",
    "RetrieverConfig": "raggedvl.models.retriever",
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())

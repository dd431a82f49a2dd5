"""Loading the checkpoint kinds other libraries write (:mod:`.detect` tells them apart).

``build_retriever`` calls :func:`load_checkpoint` first; it returns None for the kinds
``build_retriever`` handles itself (a saved raggedvl retriever, a Qwen-VL backbone).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from raggedvl.prompts import COLPALI_PROMPTS

from ..backbone import load_backbone
from ..lora import LoraSettings
from ..retriever import Retriever, RetrieverConfig
from .colpali import apply_adapter, load_colpali, read_adapter_config, resolve_base
from .detect import checkpoint_kind, local_folder
from .hf_colqwen2 import load_hf_colqwen2


def load_checkpoint(model: str | os.PathLike, *, lora: LoraSettings | None, merge_lora: bool,
                    attn_implementation: str, dtype: torch.dtype | None) -> Retriever | None:
    """A :class:`Retriever` for a colpali checkpoint or adapter or a transformers
    ``ColQwen2ForRetrieval`` checkpoint; None for the kinds ``build_retriever`` handles itself.

    ``lora``: fresh LoRA for a full checkpoint (an adapter keeps its own r, alpha and dropout);
    ``merge_lora``: fold an adapter into its base. An adapter's base may be a colpali or
    transformers retriever, a saved raggedvl retriever, or a plain backbone (then the adapter
    must save the projection whole). Raises ``ValueError`` for a local folder that is no
    checkpoint, and the loaders' errors (naming the file and the tensor).
    """
    kind = checkpoint_kind(model)
    if kind is None and Path(model).is_dir():
        raise ValueError(f"{model} holds neither a config.json nor an adapter_config.json; it is not a checkpoint")
    kwargs = {"attn_implementation": attn_implementation, "dtype": dtype}
    if kind == "colpali_adapter":
        folder = local_folder(model)
        base_name = resolve_base(folder, read_adapter_config(folder).get("base_model_name_or_path"))
        base_kind = checkpoint_kind(base_name)
        if base_kind == "colpali_adapter":
            raise ValueError(f"{folder}: the adapter's base {base_name} is itself an adapter; it must be a full checkpoint")
        base = load_checkpoint(base_name, lora=None, merge_lora=False, **kwargs)
        if base is None and base_kind == "raggedvl":
            base = Retriever.from_pretrained(base_name, attn_implementation=attn_implementation, torch_dtype=dtype)
        elif base is None:
            backbone = load_backbone(base_name, attn_implementation=attn_implementation, dtype=dtype)
            base = Retriever(backbone, RetrieverConfig(source=base_name, prompts=COLPALI_PROMPTS))
        return apply_adapter(folder, base, base_name=base_name, base_has_head=base_kind != "backbone", merge=merge_lora)
    if kind == "colpali":
        return load_colpali(local_folder(model), lora=lora, **kwargs)
    if kind == "transformers":
        return load_hf_colqwen2(local_folder(model), lora=lora, **kwargs)
    return None

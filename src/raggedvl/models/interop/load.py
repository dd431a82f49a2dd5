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
from raggedvl.families import family_of
from ..lora import LoraSettings
from ..retriever import Retriever, RetrieverConfig
from .colpali import (
    COLPALI_DIM,
    apply_adapter,
    check_adapter_fits,
    check_colpali_files,
    load_colpali,
    read_adapter,
    read_adapter_config,
    resolve_base,
)
from .detect import checkpoint_kind, checkpoint_reference, local_folder
from .hf_colqwen2 import check_hf_files, load_hf_colqwen2
from .multi_vector_encoder import check_multi_vector_encoder, load_multi_vector_encoder


def load_checkpoint(model: str | os.PathLike, *, lora: LoraSettings | None, merge_lora: bool,
                    attn_implementation: str, dtype: torch.dtype | None) -> Retriever | None:
    """A :class:`Retriever` for a colpali checkpoint or adapter, a transformers
    ``ColQwen2ForRetrieval`` checkpoint or a sentence-transformers ``MultiVectorEncoder``; None for the kinds ``build_retriever`` handles itself.

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
        retriever = apply_adapter(folder, base, base_name=base_name, base_has_head=base_kind != "backbone",
                                  merge=merge_lora)
        if retriever.config.lora is not None:
            retriever.config.base = checkpoint_reference(base_name)
        return retriever
    if kind == "colpali":
        retriever = load_colpali(local_folder(model), lora=lora, **kwargs)
    elif kind == "transformers":
        retriever = load_hf_colqwen2(local_folder(model), lora=lora, **kwargs)
    elif kind == "sentence_transformers":
        retriever = load_multi_vector_encoder(local_folder(model), lora=lora, **kwargs)
    else:
        return None
    if retriever.config.lora is not None:
        retriever.config.base = checkpoint_reference(model)
    return retriever


def check_checkpoint(model: str | os.PathLike) -> None:
    """Check a local colpali / transformers / sentence-transformers checkpoint or adapter from its JSON files and
    safetensors headers only (no weight is read; the base of an adapter is built on the meta
    device): the errors loading would raise, naming the file and the tensor, in seconds.
    ``raggedvl train`` runs this before starting torchrun. Other kinds and hub ids: nothing
    to check here (their loading checks run in every rank)."""
    from transformers import AutoConfig

    folder = Path(model)
    kind = checkpoint_kind(folder) if folder.is_dir() else None
    if kind == "colpali":
        check_colpali_files(folder, AutoConfig.from_pretrained(folder, trust_remote_code=False))
    elif kind == "transformers":
        check_hf_files(folder)
    elif kind == "sentence_transformers":
        check_multi_vector_encoder(folder)
    elif kind == "colpali_adapter":
        adapter = read_adapter(folder)
        base_name = resolve_base(folder, adapter.config.get("base_model_name_or_path"))
        base_kind = checkpoint_kind(base_name) if Path(base_name).is_dir() else None
        if base_kind == "colpali_adapter":
            raise ValueError(f"{folder}: the adapter's base {base_name} is itself an adapter; it must be a full checkpoint")
        if base_kind not in ("colpali", "backbone"):
            return  # a hub base, or another kind: checked when the ranks load it
        config = AutoConfig.from_pretrained(base_name, trust_remote_code=False)
        if base_kind == "colpali":
            check_colpali_files(Path(base_name), config)
        family = family_of(config)
        with torch.device("meta"):
            backbone = family.model_class._from_config(config)
            head = torch.nn.Linear(config.get_text_config().hidden_size, COLPALI_DIM) if base_kind == "colpali" else None
        linears = {n: m for n, m in backbone.named_modules() if isinstance(m, torch.nn.Linear)}
        check_adapter_fits(adapter, linears, head, base_name)

"""``build_retriever``: the tiny preset, a hub checkpoint, a local checkpoint or a saved retriever.

A Qwen-VL checkpoint gives the backbone (:mod:`raggedvl.models.backbone`: its base model, every
weight checked) under a new head. trust_remote_code is never used.

colpali-engine checkpoints (ColQwen2 / ColQwen2.5, full or LoRA adapter) and transformers'
``ColQwen2ForRetrieval`` checkpoints load through :mod:`raggedvl.models.interop`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from raggedvl.families import family_of

from .attention import resolve_attn_implementation
from .backbone import load_backbone
from .tiny import TinySizes, special_token_ids, tiny_backbone_config
from .lora import LoraSettings
from .interop.detect import checkpoint_reference
from .retriever import Retriever, RetrieverConfig
from .saved import is_saved_retriever, read_retriever_meta


def _as_dtype(torch_dtype: torch.dtype | str | None) -> torch.dtype | None:
    if torch_dtype is None or isinstance(torch_dtype, torch.dtype):
        return torch_dtype
    value = getattr(torch, str(torch_dtype), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"torch_dtype {torch_dtype!r} is not a torch dtype name (e.g. 'bfloat16', 'float32')")
    return value


def _tokenizer_of(processor: Any) -> Any:
    return getattr(processor, "tokenizer", processor)


_DEFAULTS = RetrieverConfig()


def _check_saved_settings(model: str, saved: RetrieverConfig, **requested: Any) -> None:
    """A saved retriever keeps its own head settings; a non-default request that differs is an error."""
    conflicts = [
        f"{key}={value!r} (saved: {getattr(saved, key)!r})"
        for key, value in requested.items()
        if value != getattr(_DEFAULTS, key) and value != getattr(saved, key)
    ]
    if conflicts:
        raise ValueError(
            f"{model} is a saved retriever whose head settings differ from the requested {', '.join(conflicts)}; "
            f"drop those arguments to use the saved ones, or build from the backbone checkpoint instead"
        )


def _load_saved(model: str, attn: str, dtype: torch.dtype | None) -> Retriever:
    """A saved raggedvl retriever; one holding only its trainable weights gets its base first."""
    meta, _ = read_retriever_meta(Path(model))
    if meta.get("weights", "full") != "trainable":
        return Retriever.from_pretrained(model, attn_implementation=attn, torch_dtype=dtype)
    base_name = meta["retriever"].get("base")
    base = build_retriever(base_name, attn_implementation=attn, torch_dtype=dtype, merge_lora=True)
    return Retriever.from_pretrained(model, attn_implementation=attn, torch_dtype=dtype, backbone=base.backbone)


def build_retriever(
    model: str = "tiny",
    *,
    processor: Any = None,
    head: str = RetrieverConfig.head,
    dim: int = RetrieverConfig.dim,
    pooling: str = RetrieverConfig.pooling,
    lora: LoraSettings | None = None,
    attn_implementation: str | None = None,
    torch_dtype: torch.dtype | str | None = None,
    gradient_checkpointing: bool = False,
    packing: bool = False,
    eps: float = RetrieverConfig.eps,
    expected_modalities: tuple[str, ...] = ("image",),
    tiny_family: str = "qwen2_vl",
    tiny_sizes: TinySizes | None = None,
    seed: int | None = None,
    merge_lora: bool = False,
) -> Retriever:
    """Build a :class:`Retriever`.

    ``model``: "tiny" (random init from :func:`tiny_backbone_config`; needs ``processor`` (or a
    tokenizer) for the vocab size and special-token ids), a directory written by
    ``Retriever.save_pretrained`` (its saved head settings are used; a non-default ``head``,
    ``dim``, ``pooling`` or ``lora`` that differs from them is a ``ValueError``), or a hub id / local transformers
    checkpoint of a Qwen2-VL, Qwen2.5-VL or Qwen3-VL model, or a retriever written by another
    library (:mod:`raggedvl.models.interop`): a colpali-engine ColQwen2 / ColQwen2.5 checkpoint
    (``lora`` adds fresh adapters), a colpali LoRA adapter folder (kept as a trainable adapter
    with its own r and alpha; ``merge_lora=True`` folds it into the base), or a transformers
    ``ColQwen2ForRetrieval`` checkpoint. Those keep their own head (``dim``) and prompts; a
    ``head``/``dim``/``pooling`` request that differs is a ``ValueError``.
    ``head``: "late_interaction" ([B, L, D] multi-vector) or "bi_encoder" ([B, D]);
    ``pooling`` ("last" | "mean") applies to the bi-encoder. ``lora``: wrap the language model
    with peft LoRA (base weights frozen; head trainable). ``seed`` makes random init
    reproducible (``torch.manual_seed``). ``packing``: padding-free sequences
    (:meth:`Retriever.set_packing`). Raises ``ValueError`` for an unknown model source,
    a tokenizer without the Qwen-VL special tokens, or a tokenizer larger than the checkpoint's
    embedding table.
    """
    attn = resolve_attn_implementation(attn_implementation)
    dtype = _as_dtype(torch_dtype)
    if seed is not None:
        torch.manual_seed(seed)
    loaded = None
    if model != "tiny":
        from .interop import load_checkpoint

        loaded = load_checkpoint(model, lora=lora, merge_lora=merge_lora, attn_implementation=attn, dtype=dtype)
    if loaded is not None:
        retriever = loaded
        _check_saved_settings(model, retriever.config, head=head, dim=dim, pooling=pooling)
    elif model != "tiny" and Path(model).is_dir() and is_saved_retriever(model):
        retriever = _load_saved(model, attn, dtype)
        _check_saved_settings(model, retriever.config, head=head, dim=dim, pooling=pooling, lora=lora)
        if merge_lora:
            retriever.merge_lora()
    else:
        if model == "tiny":
            if processor is None:
                raise ValueError(
                    "build_retriever('tiny') needs processor= (raggedvl.data.build_processor('tiny')) "
                    "to size the vocabulary and read the special-token ids"
                )
            config = tiny_backbone_config(_tokenizer_of(processor), tiny_family, tiny_sizes)
            backbone = family_of(config).model_class._from_config(config, attn_implementation=attn)
            if dtype is not None:
                backbone = backbone.to(dtype)
        else:
            backbone = load_backbone(model, attn_implementation=attn, dtype=dtype)
            if processor is not None:
                vocab = special_token_ids(_tokenizer_of(processor))["vocab_size"]
                if vocab > backbone.config.text_config.vocab_size:
                    raise ValueError(
                        f"the processor's tokenizer has {vocab} tokens but {model} embeds only "
                        f"{backbone.config.text_config.vocab_size}; use the checkpoint's own processor"
                    )
        config = RetrieverConfig(head=head, dim=dim, pooling=pooling, eps=eps,
                                 expected_modalities=tuple(expected_modalities), lora=lora, source=str(model),
                                 base=checkpoint_reference(model) if lora is not None and model != "tiny" else None)
        retriever = Retriever(backbone, config)
    retriever.set_gradient_checkpointing(gradient_checkpointing)
    retriever.set_packing(packing)
    if processor is not None and hasattr(processor, "image_processor"):
        retriever.processor = processor  # for raggedvl.embed_queries / embed_documents
    return retriever

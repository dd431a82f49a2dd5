"""``build_retriever``: the tiny preset, a hub checkpoint, a local checkpoint or a saved retriever.

Real checkpoints (``Qwen/Qwen2-VL-2B-Instruct``, ``Qwen/Qwen2.5-VL-3B-Instruct``, ...) are
``*ForConditionalGeneration`` checkpoints; the retriever loads only their base model
(``Qwen2VLModel`` etc.) with the base class's ``from_pretrained``, whose key conversion maps both
the legacy layout (``model.layers.*``, ``visual.*``) and the current one
(``model.language_model.*``, ``model.visual.*``) onto the base model; ``lm_head`` is dropped.
A checkpoint that leaves any base-model weight uninitialised is refused (``ValueError``).
``trust_remote_code`` is never used.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .attention import resolve_attn_implementation
from .families import FAMILIES, TinySizes, family_of, special_token_ids, tiny_backbone_config
from .lora import LoraSettings
from .retriever import Retriever, RetrieverConfig, is_saved_retriever

def _as_dtype(torch_dtype: torch.dtype | str | None) -> torch.dtype | None:
    if torch_dtype is None or isinstance(torch_dtype, torch.dtype):
        return torch_dtype
    value = getattr(torch, str(torch_dtype), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"torch_dtype {torch_dtype!r} is not a torch dtype name (e.g. 'bfloat16', 'float32')")
    return value


def _tokenizer_of(processor: Any) -> Any:
    return getattr(processor, "tokenizer", processor)


def load_backbone(source: str, *, attn_implementation: str, dtype: torch.dtype | None) -> torch.nn.Module:
    """The base model of a hub id or local transformers checkpoint directory (module docstring)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(source, trust_remote_code=False)
    family = family_of(config)
    kwargs: dict[str, Any] = {"attn_implementation": attn_implementation, "output_loading_info": True}
    if dtype is not None:
        kwargs["dtype"] = dtype
    backbone, info = family.model_class.from_pretrained(source, config=config, trust_remote_code=False, **kwargs)
    missing = sorted(info.get("missing_keys", ()))
    if missing:
        raise ValueError(
            f"checkpoint {source} left {len(missing)} weights of {family.model_class.__name__} uninitialised "
            f"(e.g. {missing[:4]}); is it a {family.name} checkpoint with the vision tower included?"
        )
    return backbone


_HEAD_DEFAULTS = {"head": "late_interaction", "dim": 128, "pooling": "last", "lora": None}


def _check_saved_settings(model: str, saved: RetrieverConfig, **requested: Any) -> None:
    """A saved retriever keeps its own head settings; a non-default request that differs is an error."""
    conflicts = [
        f"{key}={value!r} (saved: {getattr(saved, key)!r})"
        for key, value in requested.items()
        if value != _HEAD_DEFAULTS[key] and value != getattr(saved, key)
    ]
    if conflicts:
        raise ValueError(
            f"{model} is a saved retriever whose head settings differ from the requested {', '.join(conflicts)}; "
            f"drop those arguments to use the saved ones, or build from the backbone checkpoint instead"
        )


def build_retriever(
    model: str = "tiny",
    *,
    processor: Any = None,
    head: str = "late_interaction",
    dim: int = 128,
    pooling: str = "last",
    lora: LoraSettings | None = None,
    attn_implementation: str | None = None,
    torch_dtype: torch.dtype | str | None = None,
    gradient_checkpointing: bool = False,
    eps: float = 1e-6,
    expected_modalities: tuple[str, ...] = ("image",),
    tiny_family: str = "qwen2_vl",
    tiny_sizes: TinySizes | None = None,
    seed: int | None = None,
) -> Retriever:
    """Build a :class:`Retriever`.

    ``model``: "tiny" (random init from :func:`tiny_backbone_config`; needs ``processor`` (or a
    tokenizer) for the vocab size and special-token ids), a directory written by
    ``Retriever.save_pretrained`` (its saved head settings are used; a non-default ``head``,
    ``dim``, ``pooling`` or ``lora`` that differs from them is a ``ValueError``), or a hub id / local transformers
    checkpoint of a Qwen2-VL, Qwen2.5-VL or Qwen3-VL model.
    ``head``: "late_interaction" ([B, L, D] multi-vector) or "bi_encoder" ([B, D]);
    ``pooling`` ("last" | "mean") applies to the bi-encoder. ``lora``: wrap the language model
    with peft LoRA (base weights frozen; head trainable). ``seed`` makes random init
    reproducible (``torch.manual_seed``). Raises ``ValueError`` for an unknown model source,
    a tokenizer without the Qwen-VL special tokens, or a tokenizer larger than the checkpoint's
    embedding table.
    """
    attn = resolve_attn_implementation(attn_implementation)
    dtype = _as_dtype(torch_dtype)
    if seed is not None:
        torch.manual_seed(seed)
    if model != "tiny" and Path(model).is_dir() and is_saved_retriever(model):
        retriever = Retriever.from_pretrained(model, attn_implementation=attn, torch_dtype=dtype)
        _check_saved_settings(model, retriever.config, head=head, dim=dim, pooling=pooling, lora=lora)
    else:
        if model == "tiny":
            if processor is None:
                raise ValueError(
                    "build_retriever('tiny') needs processor= (raggedvl.data.build_processor('tiny')) "
                    "to size the vocabulary and read the special-token ids"
                )
            config = tiny_backbone_config(_tokenizer_of(processor), tiny_family, tiny_sizes)
            backbone = FAMILIES[tiny_family].model_class._from_config(config, attn_implementation=attn)
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
                                 expected_modalities=tuple(expected_modalities), lora=lora, source=str(model))
        retriever = Retriever(backbone, config)
    retriever.set_gradient_checkpointing(gradient_checkpointing)
    return retriever

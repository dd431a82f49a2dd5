"""transformers' ``ColQwen2ForRetrieval`` checkpoints to a Retriever (export: :mod:`.export`).

Layout (transformers 5): ``config.json`` with ``model_type: "colqwen2"``, ``vlm_config`` (the
Qwen2-VL / Qwen2.5-VL config) and ``embedding_dim``; weights ``vlm.*`` (the base model:
``vlm.language_model.*``, ``vlm.visual.*``; older conversions ``vlm.model.*``, which
transformers' own key conversion maps) and ``embedding_proj_layer.{weight,bias}``
(``[embedding_dim, hidden]``). The processor beside it is transformers' ``ColQwen2Processor``:
a query is ``query_prefix + query + pad_token * 10 + "\\n"``, a page is
``visual_prompt_prefix`` with its image.

Mapping onto :class:`~raggedvl.models.Retriever`: ``backbone.<name>`` <-> ``vlm.<name>``,
``head.proj.*`` <-> ``embedding_proj_layer.*``. Loading goes through transformers'
``ColQwen2ForRetrieval.from_pretrained`` (its key conversion, dtype and attention handling);
raggedvl keeps ``vlm`` as the backbone and copies the projection into the head.

Embedding equality: ``ColQwen2ForRetrieval.forward`` calls its VLM with ``input_ids=None``, so
the VLM cannot find the image tokens and gives text positions to every token (document
embeddings then differ, 0.134 max on the tiny test model) unless the caller passes the M-RoPE
``position_ids`` (``model.vlm.get_rope_index(...)``, see :func:`mrope_position_ids`). With them
its embeddings equal raggedvl's (the Retriever's backbone computes them itself).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from raggedvl.prompts import DOC_TEMPLATE, RetrievalPrompts, transformers_colqwen2_prompts

from ..backbone import check_loading_info, quiet_transformers
from raggedvl.families import family_of
from ..lora import LoraSettings
from ..retriever import Retriever, RetrieverConfig
from ..weights import TensorFiles
from .detect import exported_prompts

PROJECTION = "embedding_proj_layer"
DEFAULT_QUERY_PREFIX = "Query: "


def load_hf_colqwen2(folder: str | os.PathLike, *, lora: LoraSettings | None, attn_implementation: str,
                     dtype: torch.dtype | None) -> Retriever:
    """A :class:`Retriever` with the weights of a ``ColQwen2ForRetrieval`` checkpoint folder.

    Raises ``ValueError`` naming the file and the tensor when the projection is missing or its
    shape differs from ``[embedding_dim, hidden]``, or when a VLM weight is missing or misshapen.
    """
    from transformers import ColQwen2ForRetrieval

    folder = Path(folder)
    config = check_hf_files(folder)
    kwargs = {"attn_implementation": attn_implementation, "output_loading_info": True, "ignore_mismatched_sizes": True}
    if dtype is not None:
        kwargs["dtype"] = dtype
    with quiet_transformers():
        model, info = ColQwen2ForRetrieval.from_pretrained(folder, trust_remote_code=False, **kwargs)
    check_loading_info(info, folder, "ColQwen2ForRetrieval", "the checkpoint is incomplete")
    retriever = Retriever(model.vlm, RetrieverConfig(dim=config.embedding_dim, lora=lora, source=str(folder),
                                                     prompts=saved_processor_prompts(folder)))
    retriever.head.proj.load_state_dict({k: v.float() for k, v in model.embedding_proj_layer.state_dict().items()})
    return retriever


def check_hf_files(folder: Path) -> Any:
    """The ``ColQwen2Config`` of a checkpoint folder, its projection checked from the weights'
    headers (no weight is read). Raises ``ValueError`` naming the file and the tensor when the
    projection is missing or its shape differs from ``[embedding_dim, hidden]``."""
    from transformers import ColQwen2Config

    config = ColQwen2Config.from_pretrained(folder)
    family_of(config.vlm_config)
    files = TensorFiles(folder)
    hidden = config.vlm_config.get_text_config().hidden_size
    want = {"weight": (config.embedding_dim, hidden), "bias": (config.embedding_dim,)}
    for part, shape in want.items():
        name = f"{PROJECTION}.{part}"
        if name not in files:
            raise ValueError(f"{files.label} has no {name!r}: a ColQwen2ForRetrieval checkpoint stores its projection there")
        if tuple(files.tensors[name].shape) != shape:
            raise ValueError(
                f"{files.tensors[name].file}: tensor {name!r} has shape {list(files.tensors[name].shape)}, but "
                f"config.json (embedding_dim {config.embedding_dim}, hidden size {hidden}) needs {list(shape)}"
            )
    return config


def saved_processor_prompts(folder: Path) -> RetrievalPrompts:
    """The prompts of the ``ColQwen2Processor`` saved in ``folder`` (its ``query_prefix`` and
    ``visual_prompt_prefix``, the tokenizer's pad token and padding side); transformers'
    defaults where the folder has no processor files. A folder raggedvl exported gives back the
    retriever's exact prompts (``raggedvl_prompts.json``)."""
    from transformers import AutoTokenizer

    exported = exported_prompts(folder)
    if exported is not None:
        return exported

    path = folder / "processor_config.json"
    saved = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    pad, side = "<|endoftext|>", "right"
    if (folder / "tokenizer_config.json").is_file():
        tokenizer = AutoTokenizer.from_pretrained(folder)
        pad, side = tokenizer.pad_token or pad, tokenizer.padding_side
    return transformers_colqwen2_prompts(
        query_prefix=saved.get("query_prefix") or DEFAULT_QUERY_PREFIX,
        visual_prompt_prefix=saved.get("visual_prompt_prefix") or DOC_TEMPLATE,
        pad_token=pad, padding_side=side,
    )


def mrope_position_ids(vlm: torch.nn.Module, features: dict) -> torch.Tensor:
    """The M-RoPE ``position_ids`` ``[3, B, L]`` a ``ColQwen2ForRetrieval`` caller must pass so its
    embeddings equal the backbone's own (module docstring). ``features``: the processor output
    (``input_ids``, ``attention_mask``, ``image_grid_thw``; ``mm_token_type_ids``, which
    transformers' ``ColQwen2Processor`` does not return, is derived from the image tokens)."""
    ids = features["input_ids"]
    token_types = features.get("mm_token_type_ids")
    if token_types is None:
        token_types = (ids == vlm.config.image_token_id).to(torch.int32)
    position_ids, _ = vlm.get_rope_index(ids, mm_token_type_ids=token_types, image_grid_thw=features.get("image_grid_thw"),
                                         attention_mask=features["attention_mask"])
    return position_ids

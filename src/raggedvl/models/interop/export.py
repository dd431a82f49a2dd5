"""Writing a Retriever in the layouts colpali-engine, transformers and sentence-transformers load
without code changes.

- ``"colpali"`` (:func:`export_colpali`): ``ColQwen2`` / ``ColQwen2_5`` (Qwen2-VL / Qwen2.5-VL
  backbones). Full weights: ``config.json`` (the backbone config, ``architectures:
  ["ColQwen2"]``) + ``model.safetensors`` (``<backbone names>``, ``custom_text_proj.*``); loads
  with ``ColQwen2.from_pretrained(DIR)``. A LoRA retriever without ``merge_lora``: a peft adapter
  (``adapter_config.json`` naming the base, LoRA on the language model, the projection saved
  whole through ``modules_to_save``) that loads with ``ColQwen2.from_pretrained(DIR)`` (peft
  integration) or ``PeftModel.from_pretrained(ColQwen2.from_pretrained(base), DIR)``. colpali's
  class fixes the projection at 128 dimensions and has no bi-encoder with a projection: other
  heads are a ``ValueError`` (use the transformers format for another ``dim``).
- ``"transformers"`` (:func:`export_transformers`): ``ColQwen2ForRetrieval`` (``config.json``
  with ``vlm_config`` and ``embedding_dim``; ``vlm.<backbone names>``,
  ``embedding_proj_layer.*``), any ``dim``; LoRA is merged (the layout has no adapter form).
- ``"sentence-transformers"`` (:func:`.multi_vector_encoder.export_multi_vector_encoder`):
  sentence-transformers' ``MultiVectorEncoder`` (the base model, a ``Dense`` projection, the
  prompts and a chat template that writes the retriever's queries and pages exactly), any
  ``dim``; LoRA is merged.

Each folder also gets the processor (colpali's ``ColQwen2Processor`` layout, transformers'
``ColQwen2Processor`` with the retriever's visual prompt, or the family's processor with a chat
template for sentence-transformers) and ``raggedvl_prompts.json`` (the
retriever's exact prompts, which raggedvl reads back; the other libraries ignore the file).
Where the other library's processor writes queries differently from the retriever's prompts
(transformers' always adds a query prefix and a trailing newline), the returned notes say so.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import torch

from raggedvl.prompts import COLPALI_PROMPTS, RetrievalPrompts

from ..retriever import Retriever
from ..weights import save_tensors, write_json
from .colpali import COLPALI_DIM, PEFT_PREFIX, PROJECTION
from .detect import COLPALI_ARCHITECTURES, PROMPTS_FILE
from .hf_colqwen2 import DEFAULT_QUERY_PREFIX
from .hf_colqwen2 import PROJECTION as HF_PROJECTION

FORMATS = ("colpali", "transformers", "sentence-transformers")
_COLPALI_CLASS = {family: name for name, family in COLPALI_ARCHITECTURES.items()}
_COLPALI_PROCESSOR = {"ColQwen2": "ColQwen2Processor", "ColQwen2_5": "ColQwen2_5_Processor"}


def check_exportable(config: Any, family: str, fmt: str) -> None:
    """Raise ``ValueError`` (before any weight is touched) when a retriever with ``config``
    (a ``RetrieverConfig``) on backbone ``family`` cannot be written as ``fmt``."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
    if config.head != "late_interaction":
        raise ValueError(
            f"a {config.head} retriever cannot be exported as {fmt}: colpali-engine's and transformers' ColQwen2 "
            "classes and sentence-transformers' MultiVectorEncoder are late-interaction (multi-vector) models; "
            "colpali's BiQwen2 has no projection head"
        )
    if family not in _COLPALI_CLASS:
        raise ValueError(f"a {family} backbone cannot be exported as {fmt}: ColQwen2 covers Qwen2-VL and Qwen2.5-VL")
    if fmt == "colpali" and config.dim != COLPALI_DIM:
        raise ValueError(
            f"this retriever embeds into {config.dim} dimensions, but colpali-engine's ColQwen2 fixes its projection "
            f"(custom_text_proj) at {COLPALI_DIM}: train with --dim {COLPALI_DIM}, or export --format transformers "
            "(ColQwen2ForRetrieval takes any embedding_dim)"
        )
    if fmt == "transformers" and family != "qwen2_vl":
        raise ValueError(f"transformers' ColQwen2ForRetrieval is for Qwen2-VL backbones; this one is {family}")


def start_export(retriever: Retriever, output: str | os.PathLike, fmt: str, merged_because: str) -> tuple[Path, list[str]]:
    """The checks and first steps every full-weights export shares: ``check_exportable``, the
    output folder created, LoRA merged into the weights in place (``merged_because``: why the
    format needs it, for the model card's note). Returns the folder and the notes so far."""
    check_exportable(retriever.config, retriever.family.name, fmt)
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    notes = []
    if retriever.config.lora is not None:
        retriever.merge_lora()
        notes.append(f"LoRA adapters were merged into the weights ({merged_because})")
    return out, notes


def export_colpali(retriever: Retriever, processor: Any, output: str | os.PathLike, *, merge_lora: bool = False) -> list[str]:
    """Write ``retriever`` (and ``processor``) as a colpali-engine checkpoint (module docstring).

    ``merge_lora``: fold LoRA into the weights (in place) and write a full checkpoint; without
    it a LoRA retriever becomes an adapter on ``config.base``. Returns notes for the model card.
    Raises ``ValueError`` for a head, dimension or backbone colpali cannot hold, and for an
    adapter whose base no checkpoint holds (the tiny preset: pass ``merge_lora``).
    """
    check_exportable(retriever.config, retriever.family.name, "colpali")
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    arch = _COLPALI_CLASS[retriever.family.name]
    if retriever.config.lora is not None and merge_lora:
        retriever.merge_lora()
    head = {f"{PROJECTION}.{k}": v for k, v in retriever.head.proj.state_dict().items()}
    if retriever.config.lora is not None:
        _write_adapter(retriever, out, head)
    else:
        config = retriever.base_model.config.__class__.from_dict(retriever.base_model.config.to_dict())
        config.architectures = [arch]
        config.save_pretrained(out)
        save_tensors(out / "model.safetensors", {**retriever.base_model.state_dict(), **head})
    write_processor(processor, out, _COLPALI_PROCESSOR[arch])
    write_json(out / PROMPTS_FILE, retriever.config.prompts.to_dict())
    notes = []
    if (retriever.config.prompts.query_template, retriever.config.prompts.doc_template) != (
            COLPALI_PROMPTS.query_template, COLPALI_PROMPTS.doc_template):
        notes.append(
            f"this retriever was trained with the query template {retriever.config.prompts.query_template!r}; "
            "colpali-engine's processor writes queries as the query followed by ten <|endoftext|> tokens, so its "
            "queries differ from training"
        )
    return notes


def _write_adapter(retriever: Retriever, out: Path, head: dict[str, torch.Tensor]) -> None:
    from peft import get_peft_model_state_dict

    base = retriever.config.base
    if base is None:
        raise ValueError(
            "this LoRA retriever's frozen base is not a checkpoint (the tiny preset is random): an adapter would "
            "name nothing to load; export with --merge-lora to write the full weights"
        )
    peft_config = retriever.backbone.peft_config["default"]
    names = "|".join(sorted(retriever.config.lora.target_modules))
    adapter = peft_config.__class__(**{
        **peft_config.to_dict(),
        "target_modules": rf"(.*(model)(?!.*visual).*({names}).*$)",  # colpali's pattern: language model only
        "modules_to_save": [PROJECTION],  # raggedvl trains the whole projection
        "base_model_name_or_path": base,
        "inference_mode": True,
        "task_type": None,
    })
    adapter.save_pretrained(str(out))
    tensors = get_peft_model_state_dict(retriever.backbone)
    tensors.update({PEFT_PREFIX + k: v for k, v in head.items()})
    save_tensors(out / "adapter_model.safetensors", tensors)


def write_processor(processor: Any, out: Path, processor_class: str, chat_template: str | None = None,
                    padding_side: str | None = None) -> None:
    """The processor files as ``processor_class`` (colpali's ``ColQwen2Processor``,
    transformers' ``Qwen2VLProcessor``) lays them out, with a video processor entry (which
    ``Qwen2VLProcessor`` loads); ``chat_template``: replaces the processor's
    (``chat_template.jinja``); ``padding_side``: the tokenizer's."""
    processor.save_pretrained(str(out))
    if chat_template is not None:
        (out / "chat_template.jinja").write_text(chat_template, encoding="utf-8")
    for name in ("processor_config.json", "tokenizer_config.json"):
        path = out / name
        data = json.loads(path.read_text(encoding="utf-8"))
        data["processor_class"] = processor_class
        if chat_template is not None:
            data.pop("chat_template", None)
        if padding_side is not None and name == "tokenizer_config.json":
            data["padding_side"] = padding_side
        if name == "processor_config.json":
            image = data.get("image_processor", {})
            data.setdefault("video_processor", {  # Qwen2VLProcessor also loads a video processor
                "video_processor_type": "Qwen2VLVideoProcessor",
                **{k: image[k] for k in ("patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std")
                   if k in image},
            })
        write_json(path, data)


def export_transformers(retriever: Retriever, processor: Any, output: str | os.PathLike) -> list[str]:
    """Write ``retriever`` (and ``processor``) as a transformers ``ColQwen2ForRetrieval``
    checkpoint (module docstring); LoRA is merged into the weights in place. Returns notes for
    the model card. Raises ``ValueError`` for a head or backbone the class cannot hold."""
    from transformers import ColQwen2Config, ColQwen2Processor

    out, notes = start_export(retriever, output, "transformers", "ColQwen2ForRetrieval has no adapter layout")
    config = ColQwen2Config(vlm_config=retriever.base_model.config.to_dict(), embedding_dim=retriever.config.dim)
    config.architectures = ["ColQwen2ForRetrieval"]
    config.save_pretrained(out)
    tensors = {f"vlm.{k}": v for k, v in retriever.base_model.state_dict().items()}
    tensors.update({f"{HF_PROJECTION}.{k}": v for k, v in retriever.head.proj.state_dict().items()})
    save_tensors(out / "model.safetensors", tensors)
    prompts = retriever.config.prompts
    prefix = _transformers_query_prefix(prompts, processor.tokenizer.pad_token)
    ColQwen2Processor(image_processor=processor.image_processor, tokenizer=processor.tokenizer,
                      visual_prompt_prefix=prompts.doc_template,
                      query_prefix=prefix or DEFAULT_QUERY_PREFIX).save_pretrained(str(out))
    write_json(out / PROMPTS_FILE, prompts.to_dict())
    if prefix is None:
        notes.append(
            f"transformers' ColQwen2Processor writes a query as '{DEFAULT_QUERY_PREFIX}' + query + pad token x 10 + "
            f"newline; this retriever was trained with {prompts.query_template!r}, so queries tokenised by that "
            "processor differ from training (raggedvl reads the exact prompts back from raggedvl_prompts.json)"
        )
    return notes


def _transformers_query_prefix(prompts: RetrievalPrompts, pad_token: str) -> str | None:
    """The ``query_prefix`` that makes transformers' ColQwen2Processor write the retriever's
    queries exactly, or None when no prefix does."""
    match = re.fullmatch(r"(.+)\{query\}" + re.escape(pad_token * 10 + "\n"), prompts.query_template, flags=re.S)
    return match.group(1) if match else None

"""sentence-transformers' ``MultiVectorEncoder`` folders, both ways (export and loading).

Layout (sentence-transformers >= 6, loaded by ``MultiVectorEncoder(DIR)`` with none of
raggedvl's code and no ``trust_remote_code``):

| path | module | holds |
|---|---|---|
| ``.`` | ``Transformer`` (``feature-extraction``) | ``config.json`` + ``model.safetensors`` (the Qwen-VL base model, ``AutoModel``), the processor with its pixel limits and a chat template |
| ``1_Dense`` | ``Dense`` on ``token_embeddings`` | the retriever's projection ``H -> D`` (``linear.weight`` [D, H], ``linear.bias`` [D]), identity activation |
| ``2_MultiVectorMask`` | ``MultiVectorMask`` | no skiplist: every real token scores |
| ``3_Normalize`` | ``Normalize`` | L2 per token |

``config_sentence_transformers.json``: ``model_type: "MultiVectorEncoder"``, similarity
``"maxsim"`` and the prompts: ``query`` is the text before ``{query}`` in the retriever's query
template, ``document`` the text before the image block in its page template.
sentence-transformers passes a prompt as a system message; the chat template writes the
messages' text and images in order and then the rest of the template: the query's augmentation
tokens after text, the page template's tail after an image. ``encode_query(texts)`` and
``encode_document(images)`` thus tokenise exactly as raggedvl's collator does, padding side
included (the tokenizer's).

Why the base model and a ``Dense`` rather than transformers' ``ColQwen2ForRetrieval`` (which
sentence-transformers also loads): that class calls its VLM with ``input_ids=None``, so pages get
text positions instead of M-RoPE (:mod:`.hf_colqwen2`), and its processor always writes a
query as ``prefix + query + pads + "\\n"``; the base model computes M-RoPE from ``input_ids``
and ``mm_token_type_ids`` as raggedvl's backbone does.

Equality: the same token ids and ``pixel_values`` give raggedvl's embeddings at the real tokens
within float32 rounding. Normalisation: raggedvl divides by ``max(||x||, 1e-6)``,
sentence-transformers by ``max(||x||, 1e-12)``; they differ only for projections shorter than
``1e-6``. Pixels: raggedvl resizes pages itself (``raggedvl.images.ImagePolicy``) to the size
the processor's rule chooses, so pass ``encode_document`` the pages that policy prepared for
identical ``pixel_values``.

Loading such a folder (:func:`load_multi_vector_encoder`) takes the weights back by name and the
prompts from ``raggedvl_prompts.json`` when raggedvl wrote the folder, else by rendering the
chat template around a placeholder query and an image.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from raggedvl.prompts import IMAGE_BLOCK, RetrievalPrompts

from ..backbone import load_backbone
from ..lora import LoraSettings
from ..retriever import Retriever, RetrieverConfig
from ..weights import TensorFiles, save_tensors, write_json
from .export import start_export, write_processor
from .detect import PROMPTS_FILE, ST_CONFIG, ST_MODEL_TYPE, ST_MODULES, exported_prompts

_ST = "sentence_transformers."
TRANSFORMER = _ST + "base.modules.transformer.Transformer"
DENSE = _ST + "base.modules.dense.Dense"
MASK = _ST + "multi_vector_encoder.modules.multi_vector_mask.MultiVectorMask"
NORMALIZE = _ST + "base.modules.normalize.Normalize"
_PIPELINE = [("", TRANSFORMER), ("1_Dense", DENSE), ("2_MultiVectorMask", MASK), ("3_Normalize", NORMALIZE)]
_TOKENS = "token_embeddings"
_HIDDEN = {"method": "forward", "method_output_name": "last_hidden_state"}
_QUERY_PLACEHOLDER = "{query}"


def chat_template(prompts: RetrievalPrompts) -> str:
    """The Jinja chat template that, with sentence-transformers' prompts as system messages,
    writes queries and pages as ``prompts`` does (module docstring)."""
    query_tail = prompts.query_template.split(_QUERY_PLACEHOLDER, 1)[1]
    page_tail = prompts.doc_template.split(IMAGE_BLOCK, 1)[1]

    def literal(text: str) -> str:  # a Jinja string literal (Python escapes, as JSON writes them)
        return "{{ " + json.dumps(text, ensure_ascii=False) + " }}"

    return (
        "{%- set ns = namespace(image=false) -%}"
        "{%- for message in messages -%}"
        "{%- if message['content'] is string -%}{{ message['content'] }}"
        "{%- else -%}{%- for part in message['content'] -%}"
        "{%- if part['type'] == 'image' -%}" + literal(IMAGE_BLOCK) + "{%- set ns.image = true -%}"
        "{%- elif part['type'] == 'text' -%}{{ part['text'] }}{%- endif -%}"
        "{%- endfor -%}{%- endif -%}"
        "{%- endfor -%}"
        "{%- if ns.image -%}" + literal(page_tail) + "{%- else -%}" + literal(query_tail) + "{%- endif -%}"
    )


def st_prompts(prompts: RetrievalPrompts) -> dict[str, str]:
    """sentence-transformers' ``prompts``: the query prefix and the text before the page's image."""
    return {"query": prompts.query_prefix, "document": prompts.doc_template.split(IMAGE_BLOCK, 1)[0]}


def export_multi_vector_encoder(retriever: Retriever, processor: Any, output: str | os.PathLike) -> list[str]:
    """Write ``retriever`` (and ``processor``) as a sentence-transformers ``MultiVectorEncoder``
    folder (module docstring); LoRA is merged into the weights in place. Returns notes for the
    model card. Raises ``ValueError`` (before writing) for a head or backbone the layout cannot hold."""
    out, notes = start_export(retriever, output, "sentence-transformers",
                              "the Transformer module holds the full base model")
    prompts = retriever.config.prompts
    config = retriever.base_model.config.__class__.from_dict(retriever.base_model.config.to_dict())
    config.architectures = [retriever.base_model.__class__.__name__]
    config.save_pretrained(out)
    save_tensors(out / "model.safetensors", retriever.base_model.state_dict())
    write_processor(processor, out, retriever.family.processor_class, chat_template(prompts), prompts.padding_side)
    write_json(out / "sentence_bert_config.json", {
        "transformer_task": "feature-extraction",
        "modality_config": {"text": dict(_HIDDEN), "image": dict(_HIDDEN), "message": {**_HIDDEN, "format": "structured"}},
        "module_output_name": _TOKENS,
    })
    proj = retriever.head.proj
    (out / "1_Dense").mkdir(exist_ok=True)
    write_json(out / "1_Dense" / "config.json", {
        "in_features": proj.in_features, "out_features": proj.out_features, "bias": True,
        "activation_function": "torch.nn.modules.linear.Identity",
        "module_input_name": _TOKENS, "module_output_name": _TOKENS,
    })
    save_tensors(out / "1_Dense" / "model.safetensors", {f"linear.{k}": v for k, v in proj.state_dict().items()})
    (out / "2_MultiVectorMask").mkdir(exist_ok=True)
    write_json(out / "2_MultiVectorMask" / "config.json",
               {"skiplist_words": [], "skiplist_tasks": ["document"], "keep_only_token_ids": None})
    (out / "3_Normalize").mkdir(exist_ok=True)
    write_json(out / "3_Normalize" / "config.json", {"module_input_name": _TOKENS, "module_output_name": _TOKENS})
    write_json(out / ST_MODULES, [{"idx": i, "name": str(i), "path": path, "type": kind}
                                    for i, (path, kind) in enumerate(_PIPELINE)])
    write_json(out / ST_CONFIG, {"model_type": ST_MODEL_TYPE, "prompts": st_prompts(prompts),
                                 "default_prompt_name": None, "similarity_fn_name": "maxsim"})
    write_json(out / PROMPTS_FILE, prompts.to_dict())
    return notes


def check_multi_vector_encoder(folder: Path) -> tuple[Any, Path]:
    """The base model's config and the projection's weights file of a ``MultiVectorEncoder``
    folder, its module list and projection checked from the JSON files and the safetensors
    header (no weight is read). Raises ``ValueError`` naming the file for a module list other
    than Transformer, Dense, MultiVectorMask, Normalize, or a projection of another shape."""
    from transformers import AutoConfig

    folder = Path(folder)
    modules = json.loads((folder / ST_MODULES).read_text(encoding="utf-8"))
    found = [(m.get("path", ""), m.get("type")) for m in modules]
    if found != _PIPELINE:
        raise ValueError(
            f"{folder / ST_MODULES} lists {[t for _, t in found]}; raggedvl loads the late-interaction pipeline "
            f"{[t for _, t in _PIPELINE]} in the folders {[p for p, _ in _PIPELINE]} (what raggedvl export "
            "--format sentence-transformers writes)"
        )
    config = AutoConfig.from_pretrained(folder, trust_remote_code=False)
    dense = json.loads((folder / "1_Dense" / "config.json").read_text(encoding="utf-8"))
    hidden = config.get_text_config().hidden_size
    files = TensorFiles(folder / "1_Dense")
    want = {"linear.weight": (dense["out_features"], hidden), "linear.bias": (dense["out_features"],)}
    for name, shape in want.items():
        if name not in files or tuple(files.tensors[name].shape) != shape:
            got = list(files.tensors[name].shape) if name in files else "no such tensor"
            raise ValueError(
                f"{files.label}: tensor {name!r} is {got}, but the projection of hidden size {hidden} to "
                f"out_features {dense['out_features']} needs {list(shape)} (with bias, as raggedvl's head has)"
            )
    if dense.get("activation_function") not in (None, "torch.nn.modules.linear.Identity"):
        raise ValueError(f"{folder / '1_Dense' / 'config.json'}: activation {dense['activation_function']!r}; "
                         "raggedvl's head is linear (torch.nn.modules.linear.Identity)")
    return config, folder / "1_Dense" / "model.safetensors"


def load_multi_vector_encoder(folder: str | os.PathLike, *, lora: LoraSettings | None, attn_implementation: str,
                              dtype: torch.dtype | None) -> Retriever:
    """A :class:`Retriever` with the weights and prompts of a ``MultiVectorEncoder`` folder
    (module docstring); ``lora``: fresh LoRA on the base model. Raises ``ValueError`` as
    :func:`check_multi_vector_encoder` and the backbone loader do (naming the file and the tensor)."""
    folder = Path(folder)
    config, dense_file = check_multi_vector_encoder(folder)
    backbone = load_backbone(folder, attn_implementation=attn_implementation, dtype=dtype, config=config)
    head = load_file(str(dense_file))
    retriever = Retriever(backbone, RetrieverConfig(dim=head["linear.weight"].shape[0], lora=lora, source=str(folder),
                                                    prompts=saved_prompts(folder)))
    retriever.head.proj.load_state_dict({k.removeprefix("linear."): v.float() for k, v in head.items()})
    return retriever


def saved_prompts(folder: Path) -> RetrievalPrompts:
    """The prompts of a ``MultiVectorEncoder`` folder: ``raggedvl_prompts.json`` when raggedvl
    wrote it, else its chat template rendered around a placeholder query and an image, with
    sentence-transformers' prompts as system messages, and the tokenizer's padding side.
    Raises ``ValueError`` when the rendered page holds no image block or the query no placeholder."""
    from transformers import AutoTokenizer

    exported = exported_prompts(folder)
    if exported is not None:
        return exported
    tokenizer = AutoTokenizer.from_pretrained(folder)
    template_file = folder / "chat_template.jinja"
    template = template_file.read_text(encoding="utf-8") if template_file.is_file() else None
    prompts = json.loads((folder / ST_CONFIG).read_text(encoding="utf-8")).get("prompts") or {}

    def render(task: str, part: dict) -> str:
        system = [{"role": "system", "content": [{"type": "text", "text": prompts[task]}]}] if prompts.get(task) else []
        return tokenizer.apply_chat_template(system + [{"role": "user", "content": [part]}], tokenize=False,
                                             chat_template=template)

    query = render("query", {"type": "text", "text": _QUERY_PLACEHOLDER})
    page = render("document", {"type": "image"})
    try:
        return RetrievalPrompts(query_template=query, doc_template=page, padding_side=tokenizer.padding_side)
    except ValueError as exc:
        raise ValueError(f"{folder}: the chat template does not write a query and a page raggedvl can train on: {exc}") from exc

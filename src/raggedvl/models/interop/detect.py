"""Which kind of checkpoint a folder or hub id holds.

| kind | recognised by |
|---|---|
| ``"raggedvl"`` | ``raggedvl_retriever.json`` (or a legacy ``config.json`` with ``"format": "raggedvl-retriever"``) |
| ``"sentence_transformers"`` | ``modules.json`` + ``config_sentence_transformers.json`` with ``model_type: "MultiVectorEncoder"`` around a Qwen-VL base model (``raggedvl export --format sentence-transformers``) |
| ``"colpali_adapter"`` | ``adapter_config.json`` (peft) |
| ``"transformers"`` | ``config.json`` with ``model_type: "colqwen2"`` (``ColQwen2ForRetrieval``) |
| ``"colpali"`` | ``config.json`` naming ColQwen2 / ColQwen2_5 in ``architectures``, or weights holding ``custom_text_proj`` |
| ``"backbone"`` | any other ``config.json`` (a Qwen-VL checkpoint) |

A hub id is looked up by its small JSON files only; :func:`local_folder` downloads a retriever
repository when it has to be read as a folder (safetensors, JSON and tokenizer files: never
pickles).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable

from raggedvl.prompts import RetrievalPrompts

from ..saved import is_saved_retriever
from ..weights import TensorFiles

KINDS = ("raggedvl", "sentence_transformers", "colpali_adapter", "transformers", "colpali", "backbone")
COLPALI_ARCHITECTURES = {"ColQwen2": "qwen2_vl", "ColQwen2_5": "qwen2_5_vl"}
UNSUPPORTED_ARCHITECTURES = ("BiQwen2", "BiQwen2_5")
ADAPTER_CONFIG = "adapter_config.json"
PROMPTS_FILE = "raggedvl_prompts.json"  # the exact prompts of a retriever raggedvl exported
ST_MODULES = "modules.json"
ST_CONFIG = "config_sentence_transformers.json"
ST_MODEL_TYPE = "MultiVectorEncoder"
_SNAPSHOT_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.jinja", "*.model", "*.tiktoken"]


def colpali_architecture(architectures: Iterable[str] | None) -> str | None:
    """The colpali class among a config's ``architectures`` ("ColQwen2", ...), or None.

    Raises ``ValueError`` for BiQwen2 / BiQwen2.5, which raggedvl does not support."""
    for name in architectures or ():
        if name in UNSUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"{name} (colpali-engine's single-vector retriever) is not supported: it pools the backbone's "
                "hidden state without a projection, while raggedvl's bi-encoder head always projects"
            )
        if name in COLPALI_ARCHITECTURES:
            return name
    return None


def _hub_file(model: str, name: str) -> str | None:
    from transformers.utils import cached_file

    return cached_file(model, name, _raise_exceptions_for_missing_entries=False,
                       _raise_exceptions_for_connection_errors=False)


def checkpoint_kind(model: str | os.PathLike) -> str | None:
    """The kind of checkpoint ``model`` (a folder or hub id) holds (module table), or None when
    it has neither a config nor an adapter config. Raises ``ValueError`` for BiQwen2."""
    folder = Path(model)
    if folder.is_dir():
        if is_saved_retriever(folder):
            return "raggedvl"
        config_path: Path | None = folder / "config.json"
        adapter = (folder / ADAPTER_CONFIG).is_file()
    else:
        adapter = _hub_file(str(model), ADAPTER_CONFIG) is not None
        found = None if adapter else _hub_file(str(model), "config.json")
        config_path = Path(found) if found else None
    if adapter:
        return "colpali_adapter"
    if config_path is None or not config_path.is_file():
        return None
    config = json.loads(config_path.read_text(encoding="utf-8"))
    if config.get("model_type") == "colqwen2":
        return "transformers"  # sentence-transformers' ColQwen2ForRetrieval folders too
    if folder.is_dir() and is_multi_vector_encoder(folder):
        return "sentence_transformers"
    if colpali_architecture(config.get("architectures")) or (folder.is_dir() and _has_projection(folder)):
        return "colpali"
    return "backbone"


def is_multi_vector_encoder(folder: Path) -> bool:
    """Whether ``folder`` holds a sentence-transformers ``MultiVectorEncoder``
    (``modules.json`` and ``config_sentence_transformers.json`` naming that model type)."""
    path = Path(folder) / ST_CONFIG
    return (Path(folder) / ST_MODULES).is_file() and path.is_file() and \
        json.loads(path.read_text(encoding="utf-8")).get("model_type") == ST_MODEL_TYPE


def _has_projection(folder: Path) -> bool:
    try:
        files = TensorFiles(folder)
    except ValueError:
        return False
    return any(n.endswith("custom_text_proj.weight") for n in files.tensors)


def exported_prompts(folder: Path) -> RetrievalPrompts | None:
    """The prompts raggedvl wrote beside an exported checkpoint (``raggedvl_prompts.json``), or None."""
    path = Path(folder) / PROMPTS_FILE
    return RetrievalPrompts.from_dict(json.loads(path.read_text(encoding="utf-8"))) if path.is_file() else None


def checkpoint_reference(model: str | os.PathLike) -> str:
    """How a saved retriever names its base: the absolute path of a local folder, else the hub id."""
    return str(Path(model).resolve()) if Path(model).is_dir() else str(model)


def local_folder(model: str | os.PathLike) -> Path:
    """``model`` as a local folder: itself, or a snapshot of the hub repository (safetensors,
    JSON and tokenizer files only)."""
    if Path(model).is_dir():
        return Path(model)
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(str(model), allow_patterns=_SNAPSHOT_PATTERNS))

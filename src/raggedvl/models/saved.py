"""The on-disk format of a saved retriever: ``raggedvl_retriever.json`` + ``raggedvl_retriever.safetensors``.

``raggedvl_retriever.json`` holds ``format`` ("raggedvl-retriever"), ``format_version``, the
backbone ``family``, ``weights`` ("full", or "trainable" when only the LoRA adapters and the
head are saved and the frozen base loads from ``retriever.base``), the ``retriever`` settings
(:class:`raggedvl.models.retriever.RetrieverConfig`) and the ``backbone_config``. The
safetensors file holds the module's state dict (``backbone.*``, ``head.*``). A folder is
rebuilt offline from these two files; no code is executed from it.

Neither file has a transformers name on purpose: given a folder with ``model.safetensors``,
transformers' ``ColQwen2ForRetrieval.from_pretrained`` builds its default 80-layer model
whatever ``config.json`` says (or without one) and runs out of memory; given a raggedvl folder
it stops at once ("no file named model.safetensors"). Folders with the earlier names
(``config.json`` with ``"format": "raggedvl-retriever"`` and ``model.safetensors``) still load.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from raggedvl.families import FAMILIES

from .attention import resolve_attn_implementation
from .weights import save_tensors, write_json

CONFIG_NAME = "raggedvl_retriever.json"
WEIGHTS_NAME = "raggedvl_retriever.safetensors"
LEGACY_CONFIG_NAME = "config.json"
LEGACY_WEIGHTS_NAME = "model.safetensors"
FORMAT_VERSION = 1

_SIZE_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
              "vocab_size", "depth", "embed_dim", "out_hidden_size")


def write_settings(directory: str | os.PathLike, *, family: str, trainable_only: bool, retriever: dict,
                   backbone_config: dict) -> Path:
    """Write ``raggedvl_retriever.json`` into ``directory`` (temporary name, then renamed)."""
    meta = {
        "format": "raggedvl-retriever",
        "format_version": FORMAT_VERSION,
        "family": family,
        "weights": "trainable" if trainable_only else "full",
        "retriever": retriever,
        "backbone_config": backbone_config,
    }
    path = Path(directory) / CONFIG_NAME
    write_json(path, meta)
    return path


def write_weights(directory: str | os.PathLike, tensors: dict[str, torch.Tensor]) -> Path:
    """Write ``raggedvl_retriever.safetensors`` into ``directory`` (temporary name, then renamed)."""
    path = Path(directory) / WEIGHTS_NAME
    save_tensors(path, tensors)
    return path


def retriever_config_file(directory: str | os.PathLike) -> Path | None:
    """The settings file of a saved retriever in ``directory`` (either name), or None."""
    directory = Path(directory)
    if (directory / CONFIG_NAME).is_file():
        return directory / CONFIG_NAME
    legacy = directory / LEGACY_CONFIG_NAME
    try:
        if legacy.is_file() and json.loads(legacy.read_text()).get("format") == "raggedvl-retriever":
            return legacy
    except (OSError, json.JSONDecodeError):
        return None
    return None


def weights_file(directory: str | os.PathLike) -> Path | None:
    """The weights file of a saved retriever or training checkpoint (either name), or None."""
    for name in (WEIGHTS_NAME, LEGACY_WEIGHTS_NAME):
        if (Path(directory) / name).is_file():
            return Path(directory) / name
    return None


def is_saved_retriever(directory: str | os.PathLike) -> bool:
    """True when ``directory`` holds the settings file of a saved retriever."""
    return retriever_config_file(directory) is not None


def read_retriever_meta(directory: str | os.PathLike) -> tuple[dict, Path]:
    """Parsed settings of a saved retriever and the file they came from.

    Raises ``ValueError`` when the folder lacks either file, or its format, version or family
    is not one this version reads."""
    directory = Path(directory)
    cfg = retriever_config_file(directory)
    if cfg is not None and weights_file(directory) is None and (directory / "model" / ".metadata").is_file():
        raise ValueError(f"{directory} is a sharded training checkpoint: write it as one folder with `raggedvl export` "
                         "(or in Python: with raggedvl.app.checkpoint.as_retriever_folder(path) as folder: "
                         "build_retriever(folder))")
    if cfg is None or weights_file(directory) is None:
        raise ValueError(f"{directory} is not a saved raggedvl retriever (needs {CONFIG_NAME} and {WEIGHTS_NAME})")
    meta = json.loads(cfg.read_text())
    if meta.get("format") != "raggedvl-retriever":
        raise ValueError(f"{cfg} is not a raggedvl retriever config (format={meta.get('format')!r})")
    if meta.get("format_version") != FORMAT_VERSION or meta.get("family") not in FAMILIES:
        raise ValueError(
            f"{cfg}: unsupported format_version {meta.get('format_version')} / family {meta.get('family')!r}"
        )
    return meta, cfg


def saves_trainable_only(meta: dict) -> bool:
    """True when the folder holds only the trainable tensors (LoRA adapters and head)."""
    return meta.get("weights", "full") == "trainable"


def backbone_from_settings(meta: dict, attn_implementation: str | None = None) -> nn.Module:
    """A randomly initialised backbone of the saved family and sizes (its weights load next)."""
    family = FAMILIES[meta["family"]]
    return family.model_class._from_config(
        family.config_class.from_dict(meta["backbone_config"]),
        attn_implementation=resolve_attn_implementation(attn_implementation),
    )


def check_same_base(meta: dict, config_file: Path, backbone: nn.Module) -> None:
    """``ValueError`` when ``backbone``'s sizes differ from those the saved adapters were trained on."""
    saved, loaded = meta["backbone_config"], backbone.config.to_dict()
    base = meta["retriever"].get("base")
    for part in ("text_config", "vision_config"):
        for key in _SIZE_KEYS:
            want, got = saved.get(part, {}).get(key), loaded.get(part, {}).get(key)
            if want is not None and want != got:
                raise ValueError(
                    f"{config_file}: the adapters were trained on a base with {part}.{key} = {want}, but the base "
                    f"{base} has {got}; the base checkpoint changed or is another model"
                )


def load_weights(module: nn.Module, directory: str | os.PathLike, *, required: set[str] | None = None) -> None:
    """Load a folder's weights file into ``module``.

    ``required``: the names that must be in the file (the trainable ones, when the file leaves
    out a frozen base already in place); None: every name of the module. Raises ``ValueError``
    naming the file and the missing / unexpected keys."""
    weights = weights_file(directory)
    if weights is None:
        raise ValueError(f"{directory} holds no {WEIGHTS_NAME}")
    missing, unexpected = module.load_state_dict(load_file(str(weights)), strict=False)
    if required is not None:
        missing = sorted(set(missing) & required)
    if missing or unexpected:
        raise ValueError(
            f"{weights} does not match this retriever: {len(missing)} missing keys (e.g. {list(missing)[:3]}), "
            f"{len(unexpected)} unexpected (e.g. {list(unexpected)[:3]})"
        )

"""Loading a transformers base model (``Qwen2VLModel`` etc.) from a checkpoint, checked.

Real checkpoints (``Qwen/Qwen2-VL-2B-Instruct``, ``Qwen/Qwen2.5-VL-3B-Instruct``, ...) are
``*ForConditionalGeneration`` checkpoints; the retriever loads only their base model with the
base class's ``from_pretrained``, whose key conversion maps both the legacy layout
(``model.layers.*``, ``visual.*``) and the current one (``model.language_model.*``,
``model.visual.*``) onto the base model; ``lm_head`` is dropped. A checkpoint that leaves any
base-model weight uninitialised, or stores one with another shape, is refused (``ValueError``
naming the weights file and the tensors). ``trust_remote_code`` is never used.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import torch

from raggedvl.families import family_of


@contextlib.contextmanager
def quiet_transformers():
    """Silence transformers' load report while raggedvl checks the loading info itself."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def weights_label(source: str | os.PathLike) -> str:
    """The weights file of a local checkpoint (single file or shard index), else the source."""
    folder = Path(source)
    for name in ("model.safetensors", "model.safetensors.index.json"):
        if (folder / name).is_file():
            return str(folder / name)
    return str(source)


def load_backbone(source: str | os.PathLike, *, attn_implementation: str, dtype: torch.dtype | None,
                  config: Any = None) -> torch.nn.Module:
    """The base model of a hub id or local transformers checkpoint directory (module docstring).

    ``config``: the checkpoint's config when already read. Raises ``ValueError`` naming the
    weights file and the tensors when weights are missing or have another shape."""
    from transformers import AutoConfig

    if config is None:
        config = AutoConfig.from_pretrained(source, trust_remote_code=False)
    family = family_of(config)
    kwargs: dict[str, Any] = {"attn_implementation": attn_implementation, "output_loading_info": True,
                              "ignore_mismatched_sizes": True}
    if dtype is not None:
        kwargs["dtype"] = dtype
    with quiet_transformers():
        backbone, info = family.model_class.from_pretrained(source, config=config, trust_remote_code=False, **kwargs)
    check_loading_info(info, source, family.model_class.__name__,
                       f"is it a {family.name} checkpoint with the vision tower included?")
    return backbone


def check_loading_info(info: dict, source: str | os.PathLike, class_name: str, hint: str) -> None:
    """Raise ``ValueError`` naming the weights file and the tensor when transformers'
    ``from_pretrained(..., output_loading_info=True, ignore_mismatched_sizes=True)`` left a weight
    uninitialised or met one of another shape."""
    mismatched = sorted(info.get("mismatched_keys", ()))
    if mismatched:
        key, stored, wanted = mismatched[0]
        raise ValueError(
            f"{weights_label(source)}: tensor {key!r} has shape {list(stored)} but the config asks for {list(wanted)} "
            f"({len(mismatched)} tensor(s) differ); the weights do not match the checkpoint's config.json"
        )
    missing = sorted(info.get("missing_keys", ()))
    if missing:
        raise ValueError(
            f"{weights_label(source)} left {len(missing)} weights of {class_name} uninitialised "
            f"(e.g. {missing[:4]}); {hint}"
        )

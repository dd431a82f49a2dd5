"""Which attention kernel a backbone is built with (``attn_implementation`` of transformers)."""

from __future__ import annotations

import warnings

import torch

ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2")


def resolve_attn_implementation(requested: str | None) -> str:
    """``None`` -> "sdpa"; "flash_attention_2" falls back to "sdpa" with a warning when
    flash-attn or CUDA is missing; anything else outside ``ATTN_IMPLEMENTATIONS`` is a ``ValueError``."""
    if requested is None:
        return "sdpa"
    if requested not in ATTN_IMPLEMENTATIONS:
        raise ValueError(f"attn_implementation must be one of {ATTN_IMPLEMENTATIONS} or None, got {requested!r}")
    if requested == "flash_attention_2":
        from transformers.utils import is_flash_attn_2_available

        if not (torch.cuda.is_available() and is_flash_attn_2_available()):
            warnings.warn(
                "attn_implementation='flash_attention_2' requested but flash-attn or CUDA is unavailable; "
                "using 'sdpa' instead",
                RuntimeWarning,
                stacklevel=3,
            )
            return "sdpa"
    return requested

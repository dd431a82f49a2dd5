"""Where raggedvl caches what it builds (the rdocs dataset, the tiny preset's tokenizer)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """``cache_dir`` when given, else ``$RAGGEDVL_CACHE`` if set, else ``~/.cache/raggedvl``."""
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get("RAGGEDVL_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "raggedvl"

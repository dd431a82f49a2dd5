"""Lazy re-exports for a package ``__init__`` (PEP 562): a name is imported from the module
that holds it on first access, so importing the package stays cheap (no torch or transformers
until a name that needs them is used)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, exports: Mapping[str, str], namespace: dict[str, Any]
                 ) -> tuple[list[str], Callable[[str], Any], Callable[[], list[str]]]:
    """``(__all__, __getattr__, __dir__)`` for ``package`` whose public ``exports`` map each name
    to the module holding it; ``namespace`` is the package's ``globals()``. ``__getattr__``
    raises ``AttributeError`` for a name the package neither holds nor exports."""
    names = sorted(exports)

    def __getattr__(name: str) -> Any:
        if name in exports:
            return getattr(importlib.import_module(exports[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(list(namespace) + names)

    return names, __getattr__, __dir__

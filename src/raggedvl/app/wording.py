"""How the command line words a count: ``counted(1, "step")`` is "1 step", ``counted(3, "step")``
"3 steps", ``counted(2, "process", "processes")`` "2 processes". No torch."""

from __future__ import annotations


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` and ``noun``, singular for exactly one, else ``plural`` (default: ``noun`` + "s")."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"

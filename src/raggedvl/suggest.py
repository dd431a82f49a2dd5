"""The "did you mean" of every message: the known name a mistyped one most likely meant, or
None when none is close enough that a reader would see the mistake at once.

:func:`closest` compares names with case, leading dashes and ``_`` / ``-`` ignored
(``--Lr_Rate`` is ``lr-rate``), and two file names with the same extension by their stems (the
shared ``.parquet`` says nothing). In order, a known name is taken when it is:

1. equal (``FSDP2`` is ``fsdp2``, ``doc-id`` is ``doc_id``);
2. one edit away (an insertion, deletion, substitution or swap of neighbours: ``los``,
   ``haed``, ``rnus``), for names (stems) of two characters or more;
3. similar by ``difflib``'s ratio: at least :data:`CLOSE`, or :data:`NEAR` with the same first
   character (``tset`` / ``test``; not ``eval-every`` / ``log-every``);
4. the only known name that starts with it, when it has three characters or more or is the
   name's first words (``temp``: ``temperature``; ``bi``: ``bi_encoder``);
5. the longest known name whose ``-``-separated words start it (``lr-rate``: ``lr``;
   ``model-name``: ``model``);
6. the longest known name that abbreviates it: three characters or more, at least
   :data:`ABBREVIATION` of its length, the same first character, its characters in order
   (``negatives``: ``negs``).

Where a close name decides whether a name is refused at all (a bare ``--model`` name beside a
local folder), ``typos_only=True`` keeps rules 1-3. Standard library only."""

from __future__ import annotations

import difflib
import os
from collections.abc import Iterable

CLOSE = 0.8  # difflib ratio that is a likely typo whatever the first character
NEAR = 0.75  # ... with the same first character
MIN_PREFIX = 3  # characters a name must have to stand for a longer one it starts
ABBREVIATION = 0.4  # the shortest abbreviation, as a fraction of the name's length


def _normal(name: str) -> str:
    return name.casefold().lstrip("-").replace("_", "-")


def _compared(a: str, b: str) -> tuple[str, str]:
    """The parts of two normal names compared: their stems when both have the same extension."""
    (stem_a, ext_a), (stem_b, ext_b) = os.path.splitext(a), os.path.splitext(b)
    return (stem_a, stem_b) if ext_a and ext_a == ext_b and stem_a and stem_b else (a, b)


def _one_edit(a: str, b: str) -> bool:
    """Whether ``a`` and ``b`` differ by exactly one insertion, deletion, substitution or swap of
    two neighbouring characters."""
    if a == b or abs(len(a) - len(b)) > 1:
        return False
    if len(a) == len(b):
        diff = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
        return len(diff) == 1 or (len(diff) == 2 and diff[1] == diff[0] + 1
                                  and a[diff[0]] == b[diff[1]] and a[diff[1]] == b[diff[0]])
    short, long = (a, b) if len(a) < len(b) else (b, a)
    i = next((i for i, (x, y) in enumerate(zip(short, long)) if x != y), len(short))
    return short[i:] == long[i + 1:]


def closest(name: str, known: Iterable[str], *, typos_only: bool = False) -> str | None:
    """The entry of ``known`` that ``name`` most likely meant (module docstring; ``typos_only``:
    rules 1-3), as spelled in ``known``; None when none is close."""
    known = list(dict.fromkeys(known))
    key = _normal(name)
    normal = {k: _normal(k) for k in known}
    for k in known:
        if normal[k] == key:
            return k
    pairs = {k: _compared(key, normal[k]) for k in known}
    for k in known:
        if len(pairs[k][0]) >= 2 and _one_edit(*pairs[k]):
            return k
    ratios = {k: difflib.SequenceMatcher(None, *pairs[k]).ratio() for k in known}
    best = max(known, key=ratios.__getitem__, default=None)
    if best is not None:
        a, b = pairs[best]
        if ratios[best] >= CLOSE or (ratios[best] >= NEAR and a[:1] == b[:1]):
            return best
    if typos_only:
        return None
    longer = [k for k in known if normal[k].startswith(key)]
    if len(longer) == 1 and (len(key) >= MIN_PREFIX or normal[longer[0]].startswith(key + "-")):
        return longer[0]
    words = key.split("-")
    heads = [k for k in known if len(normal[k].split("-")) < len(words)
             and words[:len(normal[k].split("-"))] == normal[k].split("-")]
    if heads:
        return max(heads, key=lambda k: len(normal[k]))
    short = [k for k in known if MIN_PREFIX <= len(normal[k]) < len(key) and len(normal[k]) >= ABBREVIATION * len(key)
             and normal[k][0] == key[0] and _in_order(normal[k], key)]
    return max(short, key=lambda k: len(normal[k])) if short else None


def _in_order(short: str, long: str) -> bool:
    """Whether the characters of ``short`` occur in ``long`` in the same order."""
    rest = iter(long)
    return all(c in rest for c in short)

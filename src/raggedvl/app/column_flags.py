"""Column errors named by the command line's flags: a library :class:`~raggedvl.data.columns.ColumnError`
says which column is wrong; here its fix names the flag and config key that set it."""

from __future__ import annotations

import contextlib
from typing import Iterator

from raggedvl.data.columns import ColumnError


def column_fix(role: str, prefix: str = "", *, keys: bool = True) -> str:
    """How a user fixes the column of ``role``: its flag and, with ``keys`` (``raggedvl train``:
    every flag is also a config key), its key (``prefix`` ``"eval_"``: the evaluation set's own,
    ``--eval-query-column``; hard negatives and sources are training only). No id column is
    ``none`` for ``--id-column`` of ``raggedvl train``, else ``''`` (there none takes the training
    id column, or the run's)."""
    training_only = role in ("negatives", "source")
    key = f"{role}_column" if training_only else f"{prefix}{role}_column"
    named = f"--{key.replace('_', '-')}" + (f" (key {key})" if keys else "")
    if role == "id" and (prefix or not keys):  # none takes id_column (eval / mine: the run's): '' is no column
        return f"pass {named} naming the right one, or '' for no id column"
    return f"pass {named} naming the right one" + (", or none" if training_only or role == "id" else "")


@contextlib.contextmanager
def flags_for_columns(prefix: str = "", *, keys: bool = True) -> Iterator[None]:
    """Re-raise a ``ColumnError`` from the block as a ``ValueError`` whose fix names the flag
    (:func:`column_fix`; ``keys=False`` for commands without a config)."""
    try:
        yield
    except ColumnError as exc:
        raise exc.with_fix(column_fix(exc.role, prefix, keys=keys)) from None

"""Which columns of a table of (query, page image) rows hold what, and the error a column
setting that does not fit the data raises.

Library functions take one :class:`Columns`; their errors say which column (``role``) is wrong
in library terms (``Columns(image=...)``). The command line names its own flag for the same
fix (:meth:`ColumnError.with_fix`), so flag names stay at the command-line edge."""

from __future__ import annotations

from dataclasses import dataclass

ROLES = ("query", "image", "id", "negatives", "source")


@dataclass(frozen=True)
class Columns:
    """``query``: the query text (None: documents only, every row's query None, as an index of
    page images reads them); ``image``: the page image (datasets ``Image``, encoded bytes
    or a path); ``id``: each row's id (None: an image folder's file paths relative to the
    folder, else ``"<split>-<row>"``); ``negatives``: hard-negative images, one or a list per
    row (None: none); ``source``: a value naming each row's source (one-source batches; None:
    none)."""

    query: str | None = "query"
    image: str = "image"
    id: str | None = None
    negatives: str | None = None
    source: str | None = None

    def __post_init__(self) -> None:
        for role in ROLES:
            value = getattr(self, role)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"Columns({role}=...) must be a column name, got {value!r}")


class ColumnError(ValueError):
    """A column setting that does not fit the data: ``problem`` (what is wrong, with the table,
    the columns present and the closest name), ``role`` (which of :data:`ROLES`). The message
    ends with the library's fix; :meth:`with_fix` gives the same error with another fix (a
    command-line flag)."""

    def __init__(self, problem: str, role: str) -> None:
        self.problem, self.role = problem, role
        super().__init__(self._joined(f"pass Columns({role}=...) naming the right one"))

    def with_fix(self, fix: str) -> ValueError:
        return ValueError(self._joined(fix))

    def _joined(self, fix: str) -> str:
        return f"{self.problem}{' ' if self.problem.endswith('?') else '; '}{fix}"

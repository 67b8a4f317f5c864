"""The one error a trace loader raises: it says which file, which record, which field, and what is wrong."""

from __future__ import annotations

import os


class TraceError(ValueError):
    """A trace file that cannot be read as requests.

    `record` locates the problem inside the file (``"request '0a84…' segment 1"``,
    ``"line 3 (request 'r1')"``, ``"file"`` for the file as a whole); `field` is the
    key at fault, or None when the record as a whole is wrong.
    """

    def __init__(self, path: str | os.PathLike[str], record: str, field: str | None, problem: str) -> None:
        self.path = os.fspath(path)
        self.record = record
        self.field = field
        self.problem = problem
        super().__init__(self._message())

    def _message(self) -> str:
        where = f"{self.path}: {self.record}"
        if self.field is not None:
            where += f": field {self.field!r}"
        return f"{where}: {self.problem}"

    def __reduce__(self):  # keep the four attributes across pickling (multiprocessing workers)
        return (type(self), (self.path, self.record, self.field, self.problem))


def describe(value: object) -> str:
    """A short, type-revealing rendering of a bad value for an error message."""
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{text} ({type(value).__name__})"

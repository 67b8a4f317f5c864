"""What a trace loader reports: one error (file, record, field, problem), and one warning for lenient reads."""

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


class TraceWarning(UserWarning):
    """A trace that loaded, but only because some values were read differently from what the file says.

    One warning per file and kind of problem, not one per record, so that a published trace
    with a handful of odd values does not flood the output. `records` lists every record
    read leniently (``"request '7_2' segment 5"``); the message names the first few.
    Loaders that take ``strict=True`` raise a TraceError for the first such record instead.
    """

    def __init__(self, path: str | os.PathLike[str], field: str, records: tuple[str, ...], treatment: str) -> None:
        self.path = os.fspath(path)
        self.field = field
        self.records = tuple(records)
        self.treatment = treatment
        super().__init__(self._message())

    def _message(self) -> str:
        shown = ", ".join(self.records[:_SHOWN])
        more = f" and {len(self.records) - _SHOWN} more" if len(self.records) > _SHOWN else ""
        noun = "segment" if len(self.records) == 1 else "segments"
        return (
            f"{self.path}: {len(self.records)} {noun} with field {self.field!r} {self.treatment}: "
            f"{shown}{more} (strict loading rejects them)"
        )

    def __reduce__(self):
        return (type(self), (self.path, self.field, self.records, self.treatment))


_SHOWN = 3  # records named in a TraceWarning's message


def describe(value: object) -> str:
    """A short, type-revealing rendering of a bad value for an error message."""
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{text} ({type(value).__name__})"

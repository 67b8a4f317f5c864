"""Reading an event trace for the audit: one event per line, each checked against the schema's
required fields, with the line number of anything that cannot be read.

The required fields per event come from the shipped schema (`metrics/trace.schema.json`),
the one place they are stated. The audit does not need `jsonschema`: it checks presence and
the few types its checks rely on, which is what keeps auditing 10,000 requests fast.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from typing import Any

from marsched.metrics.trace import SCHEMA_PATH, SCHEMA_VERSION


class TraceReadError(ValueError):
    """The trace cannot be audited: names the file, the line and what is wrong."""

    def __init__(self, path: str, line: int, message: str) -> None:
        super().__init__(f"{path}: line {line}: {message}")
        self.path, self.line = path, line


@cache
def required_fields() -> dict[str, frozenset[str]]:
    schema = json.loads(SCHEMA_PATH.read_text())
    return {name: frozenset(d["required"]) for name, d in schema["$defs"].items() if name != "policy"}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True, slots=True)
class Line:
    number: int
    event: dict[str, Any]


def read_events(path: str | os.PathLike[str]) -> Iterator[Line]:
    """The trace's events in file order; the first must be a `run` event of this schema version."""
    path = os.fspath(path)
    required = required_fields()
    try:
        file = open(path, encoding="utf-8")
    except OSError as error:
        raise TraceReadError(path, 0, f"cannot open: {error.strerror or error}") from None
    decode = json.JSONDecoder().raw_decode  # json.loads less its per-line whitespace scans
    with file:
        first = True
        try:
            for number, text in enumerate(file, 1):
                text = text.strip()
                if not text:
                    continue
                try:
                    event, end = decode(text)
                except json.JSONDecodeError as error:
                    raise TraceReadError(path, number, f"not JSON ({error.msg} at character {error.pos + 1})") from None
                if end != len(text):
                    raise TraceReadError(path, number, f"more than one JSON value (at character {end + 1})")
                yield Line(number, _checked(path, number, event, required, first))
                first = False
        except UnicodeDecodeError as error:
            raise TraceReadError(path, 0, f"not UTF-8 text ({error.reason})") from None
        if first:
            raise TraceReadError(path, 0, "no events (an empty trace)")


def _checked(path: str, number: int, event: Any, required: dict[str, frozenset[str]], first: bool) -> dict:
    if not isinstance(event, dict):
        raise TraceReadError(path, number, f"an event must be a JSON object, got {type(event).__name__}")
    kind = event.get("event")
    if kind not in required:
        raise TraceReadError(path, number, f"unknown event {kind!r}; known: {', '.join(sorted(required))}")
    if not required[kind] <= event.keys():
        missing = required[kind] - event.keys()
        raise TraceReadError(path, number, f"{kind} event without {', '.join(sorted(missing))} "
                                           f"(required by trace schema v{SCHEMA_VERSION})")
    t = event["t"]
    if type(t) is not float and not _is_number(t):  # the common case first: a float
        raise TraceReadError(path, number, f"field 't' must be a finite number of seconds, got {event['t']!r}")
    if "rid" in required[kind] and not (isinstance(event["rid"], str) and event["rid"]):
        raise TraceReadError(path, number, f"field 'rid' must be a non-empty string, got {event['rid']!r}")
    if first and kind != "run":
        raise TraceReadError(path, number, f"the first event must be 'run' (the engine and policy it ran), got {kind!r}")
    if kind == "run" and event["schema_version"] != SCHEMA_VERSION:
        raise TraceReadError(path, number, f"schema version {event['schema_version']!r}; this marsched reads "
                                           f"version {SCHEMA_VERSION}")
    return event

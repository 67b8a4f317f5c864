"""One entry point for traces: a file path (format chosen by extension) or the name of a bundled trace.

The bundled traces ship as package data (``marsched/workload/data``, found in any install);
the repository keeps identical copies in ``data/workloads``. Each has a short name, a few
aliases (the older ``bundled`` among them) and its file name, all accepted by `load_trace`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from importlib.resources import files
from importlib.resources.abc import Traversable
from pathlib import Path

from marsched.workload.errors import TraceError
from marsched.workload.infercept_json import load_infercept_json, parse_infercept_json
from marsched.workload.jsonl import load_jsonl, parse_jsonl
from marsched.workload.model import Request


@dataclass(frozen=True, slots=True)
class NamedTrace:
    """A bundled trace: its name, the other names it answers to, its file, and a line for help texts."""

    name: str
    aliases: tuple[str, ...]
    file: str
    summary: str

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases, self.file)

    def resource(self) -> Traversable:
        return files("marsched.workload") / "data" / self.file


NAMED_TRACES: tuple[NamedTrace, ...] = (
    NamedTrace("single", ("bundled", "infercept_single_api"), "infercept_single_api.json",
               "INFERCEPT/MARS single-API mixture, 397 requests, 1 call each"),
    NamedTrace("multi", ("infercept_multi_api",), "infercept_multi_api.json",
               "INFERCEPT/MARS multi-API mixture, 397 requests, 1 to 16 calls"),
    NamedTrace("agent", ("agent_long_context",), "agent_long_context.jsonl",
               "synthetic long-context agent, 400 requests, 2 to 10 tool calls, contexts up to 12k tokens"),
)
TRACE_NAMES: tuple[str, ...] = tuple(trace.name for trace in NAMED_TRACES)  # the short names, for help texts
_BY_NAME = {name: trace for trace in NAMED_TRACES for name in trace.names}

_FORMATS = (".json", ".jsonl")  # by file extension, case-insensitive


def named_trace(name: str) -> NamedTrace | None:
    """The bundled trace that `name` (a name, an alias or its file name) means, or None."""
    return _BY_NAME.get(name)


def bundled_trace() -> Traversable:
    """The bundled INFERCEPT single-API trace (the trace ``bundled`` has always meant)."""
    return _BY_NAME["single"].resource()


def load_bundled() -> list[Request]:
    """The bundled single-API trace's 397 requests."""
    return load_named("single")


def load_named(name: str, *, strict: bool = False) -> list[Request]:
    """A bundled trace's requests, by name, alias or file name; TraceError listing the names if unknown."""
    trace = named_trace(name)
    if trace is None:
        raise TraceError(name, "file", None, f"not a bundled trace name: {_known_names()}")
    resource = trace.resource()
    if trace.file.endswith(".jsonl"):
        return parse_jsonl(resource.read_bytes(), source=str(resource))  # our format is always strict
    return parse_infercept_json(resource.read_bytes(), source=str(resource), strict=strict)


def load_trace(path_or_name: str | os.PathLike[str], strict: bool = False) -> list[Request]:
    """Requests from a trace file (.json: INFERCEPT/MARS, .jsonl: marsched) or a bundled trace's name.

    `strict` rejects what the INFERCEPT loader otherwise reads leniently with a warning
    (a negative API return length); marsched JSONL is always strict.
    """
    if isinstance(path_or_name, str) and path_or_name in _BY_NAME:
        return load_named(path_or_name, strict=strict)
    path = Path(path_or_name)
    suffix = path.suffix.lower()
    if suffix not in _FORMATS:
        known = " or ".join(_FORMATS)
        raise TraceError(
            path,
            "file",
            None,
            f"unknown trace format {path.suffix or '(no extension)'!r}: expected a {known} file, "
            f"or a bundled trace name: {_known_names()}",
        )
    if suffix == ".json":
        return load_infercept_json(path, strict=strict)
    return load_jsonl(path)


def _known_names() -> str:
    return "; ".join(f"{t.name} (also {', '.join(t.names[1:])})" for t in NAMED_TRACES)

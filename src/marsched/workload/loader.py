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

from marsched.workload._checks import Source, decode_utf8, gunzipped, read_trace_bytes
from marsched.workload.claude_code import is_claude_code, parse_claude_code
from marsched.workload.errors import TraceError
from marsched.workload.infercept_json import load_infercept_json, parse_infercept_json
from marsched.workload.jsonl import parse_jsonl
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
    NamedTrace("claude-code", ("claude_code_sessions",), "claude_code_sessions.jsonl.gz",
               "360 real Claude Code conversations as 3,377 tasks, 1 to 268 calls each, contexts up to 895k "
               "tokens (use --token-scale)"),
)
TRACE_NAMES: tuple[str, ...] = tuple(trace.name for trace in NAMED_TRACES)  # the short names, for help texts
_BY_NAME = {name: trace for trace in NAMED_TRACES for name in trace.names}

_FORMATS = (".json", ".jsonl", ".jsonl.gz")  # by file extension, case-insensitive


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
    if trace.file.endswith((".jsonl", ".jsonl.gz")):
        return parse_lines(resource.read_bytes(), source=str(resource))
    return parse_infercept_json(resource.read_bytes(), source=str(resource), strict=strict)


def parse_lines(data: bytes | str, source: Source) -> list[Request]:
    """JSON Lines, plain or gzip: Claude Code sessions when the first record is one, else marsched JSONL.

    Both are always strict.
    """
    text = decode_utf8(gunzipped(data, source), source)
    if is_claude_code(text):
        return parse_claude_code(text, source=source)
    return parse_jsonl(text, source=source)


def load_trace(path_or_name: str | os.PathLike[str], strict: bool = False) -> list[Request]:
    """Requests from a trace file or a bundled trace's name.

    .json: INFERCEPT/MARS; .jsonl (or .jsonl.gz): marsched JSONL, or Claude Code sessions when
    its first record has ``requests`` (`marsched.workload.claude_code`). `strict` rejects what
    the INFERCEPT loader otherwise reads leniently with a warning (a negative API return
    length); the JSON Lines formats are always strict.
    """
    if isinstance(path_or_name, str) and path_or_name in _BY_NAME:
        return load_named(path_or_name, strict=strict)
    path = Path(path_or_name)
    suffix = "".join(path.suffixes[-2:]).lower() if path.name.lower().endswith(".jsonl.gz") else path.suffix.lower()
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
    return parse_lines(read_trace_bytes(path), source=path)


def _known_names() -> str:
    return "; ".join(f"{t.name} (also {', '.join(t.names[1:])})" for t in NAMED_TRACES)

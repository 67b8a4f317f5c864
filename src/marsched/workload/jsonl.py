"""marsched's own trace format: JSON Lines, one request per line, lengths in tokens.

    {"id": "r1", "arrival_s": 0.0, "prompt_tokens": 392, "segments": [{"output_tokens": 127, "api": {"type": "math", "duration_s": 0.0001, "return_tokens": 21}}, {"output_tokens": 47}]}

Request keys: ``id`` (non-empty string, unique in the file), ``prompt_tokens`` (integer >= 0),
``segments`` (non-empty list), and optionally ``arrival_s`` (seconds >= 0, default 0) and
``template_id`` (string: the request this one was sampled from) and ``spawned_by``
(``{"parent": id, "segment": index}``: the request whose call starts this one, a subagent;
see `Request.spawned_by`), ``conversation`` (string) and ``follows``
(``{"previous": id, "gap_s": seconds, "shared_tokens": count}``: the conversation's task this
one follows, see `FollowUp`; ``shared_tokens`` at most ``prompt_tokens``). Segment keys:
``output_tokens`` (integer >= 0) and ``api`` with ``type`` (one of the `ApiType` values:
math, qa, ve, chatbot, tts, image, tool, other), ``duration_s`` (seconds >= 0) and
``return_tokens`` (integer >= 0), and optionally ``kept_tokens`` (integer >= 0, at most the
context at the call: the prefix the next segment keeps when the call compacts the
context, see `ApiCall`). ``api`` is required on every segment but the last and
optional on the last (a trailing call: the request ends when it returns, see `Request`).
The format is our own, so it is always strict: a negative count is an error, never read as
0 as the INFERCEPT loader does by default. Contexts are not stored: segment i+1
starts from segment i's context + output + API return. Unknown keys are errors, so that a
misspelt optional key is not silently ignored. Blank lines are skipped; requests keep the
file's order. The full description, with examples, is docs/trace-format.md.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path

from marsched.atomic import write_atomically
from marsched.workload._checks import (
    Source,
    decode_utf8,
    object_line,
    read_trace_bytes,
    require_count,
    require_seconds,
    require_text,
)
from marsched.workload.errors import TraceError, describe
from marsched.workload.model import ApiCall, ApiType, FollowUp, Request, Spawn, build_request

_REQUEST_KEYS = {"id", "arrival_s", "prompt_tokens", "segments", "template_id", "spawned_by", "conversation", "follows"}
_SEGMENT_KEYS = {"output_tokens", "api"}
_API_KEYS = {"type", "duration_s", "return_tokens", "kept_tokens"}
_SPAWN_KEYS = {"parent", "segment"}
_FOLLOWS_KEYS = {"previous", "gap_s", "shared_tokens"}
_API_TYPES = {t.value: t for t in ApiType}


def load_jsonl(path: str | os.PathLike[str]) -> list[Request]:
    """Read a JSONL trace; raises TraceError naming file, line, request id and field."""
    return parse_jsonl(read_trace_bytes(path), source=path)


def parse_jsonl(data: bytes | str, source: Source) -> list[Request]:
    """Parse JSONL content; `source` names it in errors."""
    requests: list[Request] = []
    first_line: dict[str, int] = {}
    for number, line in enumerate(decode_utf8(data, source).splitlines(), start=1):
        if not line.strip():
            continue
        request = _parse_line(line, number, source)
        if request.request_id in first_line:
            raise TraceError(
                source,
                f"line {number} (request {request.request_id!r})",
                "id",
                f"repeats the id of line {first_line[request.request_id]}",
            )
        first_line[request.request_id] = number
        requests.append(request)
    if not requests:
        raise TraceError(source, "file", None, "contains no requests")
    return requests


def request_to_record(request: Request) -> dict:
    """The JSON object of one line."""
    record: dict = {"id": request.request_id, "arrival_s": request.arrival_s, "prompt_tokens": request.prompt_tokens}
    if request.template_id:
        record["template_id"] = request.template_id
    if request.spawned_by is not None:
        record["spawned_by"] = {"parent": request.spawned_by.parent_id, "segment": request.spawned_by.segment_index}
    if request.conversation:
        record["conversation"] = request.conversation
    if request.follows is not None:
        record["follows"] = {"previous": request.follows.previous_id, "gap_s": request.follows.gap_s,
                             "shared_tokens": request.follows.shared_tokens}
    segments = []
    for segment in request.segments:
        item: dict = {"output_tokens": segment.output_tokens}
        if segment.api is not None:
            item["api"] = {
                "type": segment.api.api_type.value,
                "duration_s": segment.api.duration_s,
                "return_tokens": segment.api.return_tokens,
            }
            if segment.api.kept_tokens is not None:
                item["api"]["kept_tokens"] = segment.api.kept_tokens
        segments.append(item)
    record["segments"] = segments
    return record


def save_jsonl(requests: Iterable[Request], path: str | os.PathLike[str]) -> Path:
    """Write `requests` as JSONL, atomically: the file is either the old one or complete, never partial."""
    requests = list(requests)
    seen: set[str] = set()
    for request in requests:
        if not request.request_id or request.request_id in seen:
            raise ValueError(f"save_jsonl: request id {request.request_id!r} is empty or repeated; the file would not load")
        seen.add(request.request_id)
    # Serialize first: an unserializable value fails before anything touches the disk.
    text = "".join(json.dumps(request_to_record(r), allow_nan=False) + "\n" for r in requests)
    return write_atomically(path, lambda file: file.write(text.encode("utf-8")))


def _parse_line(line: str, number: int, source: Source) -> Request:
    record, request_id = object_line(line, number, source, "")
    where = f"line {number} (request {request_id!r})"
    _reject_unknown(record, _REQUEST_KEYS, source, where)
    arrival_s = require_seconds(record.get("arrival_s", 0.0), source, where, "arrival_s")
    template_id = require_text(record.get("template_id", ""), source, where, "template_id")
    prompt_tokens = require_count(_required(record, "prompt_tokens", source, where), source, where, "prompt_tokens")
    segments = _required(record, "segments", source, where)
    if not isinstance(segments, list) or not segments:
        raise TraceError(source, where, "segments", f"must be a non-empty list, got {describe(segments)}")
    parts = [
        _parse_segment(segment, index == len(segments) - 1, source, f"{where} segment {index}")
        for index, segment in enumerate(segments)
    ]
    spawned_by = _parse_spawn(record["spawned_by"], source, where) if "spawned_by" in record else None
    conversation = require_text(record.get("conversation", ""), source, where, "conversation")
    follows = _parse_follows(record["follows"], prompt_tokens, source, where) if "follows" in record else None
    context = prompt_tokens
    for index, (output_tokens, api) in enumerate(parts):  # what a call keeps must exist
        if api is not None and api.kept_tokens is not None and api.kept_tokens > context + output_tokens:
            raise TraceError(source, f"{where} segment {index}", "api.kept_tokens",
                             f"{api.kept_tokens} is more than the {context + output_tokens} tokens of context at the call")
        context = api.next_context(context + output_tokens) if api is not None else context
    request = build_request(request_id, prompt_tokens, parts, arrival_s)
    return replace(request, template_id=template_id, spawned_by=spawned_by, conversation=conversation, follows=follows)


def _nested(value: object, name: str, keys: set[str], id_key: str, source: Source, where: str) -> tuple[dict, str]:
    """Field `name`'s JSON object, holding none but `keys`, and its non-empty string `id_key`."""
    if not isinstance(value, dict):
        raise TraceError(source, where, name, f"must be a JSON object, got {describe(value)}")
    _reject_unknown(value, keys, source, where, prefix=f"{name}.")
    text = _required(value, id_key, source, where, f"{name}.")
    if not isinstance(text, str) or not text:
        raise TraceError(source, where, f"{name}.{id_key}", f"must be a non-empty string, got {describe(text)}")
    return value, text


def _parse_spawn(value: object, source: Source, where: str) -> Spawn:
    value, parent = _nested(value, "spawned_by", _SPAWN_KEYS, "parent", source, where)
    segment = require_count(_required(value, "segment", source, where, "spawned_by."), source, where,
                            "spawned_by.segment")
    return Spawn(parent, segment)


def _parse_follows(value: object, prompt_tokens: int, source: Source, where: str) -> FollowUp:
    value, previous = _nested(value, "follows", _FOLLOWS_KEYS, "previous", source, where)
    gap_s = require_seconds(_required(value, "gap_s", source, where, "follows."), source, where, "follows.gap_s")
    shared = require_count(_required(value, "shared_tokens", source, where, "follows."), source, where,
                           "follows.shared_tokens")
    if shared > prompt_tokens:
        raise TraceError(source, where, "follows.shared_tokens", f"{shared} is more than the {prompt_tokens} prompt tokens")
    return FollowUp(previous, gap_s, shared)


def _parse_segment(segment: object, last: bool, source: Source, where: str) -> tuple[int, ApiCall | None]:
    if not isinstance(segment, dict):
        raise TraceError(source, where, None, f"must be a JSON object, got {describe(segment)}")
    _reject_unknown(segment, _SEGMENT_KEYS, source, where)
    output_tokens = require_count(_required(segment, "output_tokens", source, where), source, where, "output_tokens")
    if last and "api" not in segment:
        return output_tokens, None  # the last segment may end with a call (a trailing call) or not
    api = _required(segment, "api", source, where)
    if not isinstance(api, dict):
        raise TraceError(source, where, "api", f"must be a JSON object, got {describe(api)}")
    _reject_unknown(api, _API_KEYS, source, where, prefix="api.")
    api_type = _required(api, "type", source, where, prefix="api.")
    if not isinstance(api_type, str) or api_type not in _API_TYPES:
        raise TraceError(source, where, "api.type", f"must be one of {', '.join(_API_TYPES)}, got {describe(api_type)}")
    duration_s = require_seconds(_required(api, "duration_s", source, where, "api."), source, where, "api.duration_s")
    return_tokens = require_count(_required(api, "return_tokens", source, where, "api."), source, where, "api.return_tokens")
    kept_tokens = None
    if "kept_tokens" in api:
        kept_tokens = require_count(api["kept_tokens"], source, where, "api.kept_tokens")
    return output_tokens, ApiCall(_API_TYPES[api_type], duration_s, return_tokens, kept_tokens)


def _required(record: dict, key: str, source: Source, where: str, prefix: str = "") -> object:
    if key not in record:
        raise TraceError(source, where, prefix + key, "missing")
    return record[key]


def _reject_unknown(record: dict, known: set[str], source: Source, where: str, prefix: str = "") -> None:
    unknown = sorted(set(record) - known)
    if unknown:
        raise TraceError(source, where, prefix + unknown[0], f"unknown key (expected {', '.join(sorted(known))})")

"""The INFERCEPT/MARS JSON trace: an object of request id -> list of segments.

Every segment but the last ends with one API call; the last has none. Two encodings:

- token counts: ``prompt_tokens``, ``completion_tokens``, ``api_time`` (s), ``api_token_length``;
- text: ``prompt``, ``completion``, ``api_time`` (s), ``api_token``, counted with the GPT-2
  tokenizer (GPT-J's), see `marsched.workload.tokenizer`.

A request's encoding is the one its segment 0 uses. Only segment 0's prompt is new input;
later contexts are derived (previous context + output + API return), so later ``prompt``
texts are never tokenized. A later ``prompt_tokens`` that is present must agree with the
derived context: a file that disagrees describes a different model of the request, and
simulating it silently would be wrong. ``api_time`` 0 with a return is a call of zero
duration. Keys other than these are ignored. Requests keep the file's order; arrival is 0.

API types are not stored in the file. They are labelled from the data as follows, which
was checked on the bundled trace (``infercept_single_api.json``, 397 requests):

- token-count records, per call, by its ``api_time``: below 0.01 s is MATH (observed
  0 s to 6e-4 s), 0.01 s up to 0.2 s is VE (observed 0.052 s to 0.111 s), 0.2 s and above
  is QA (observed 0.275 s to 0.994 s). The gaps between the groups are two orders of
  magnitude and a factor of 2.5, so the thresholds sit well clear of every record.
- text records, by request id: a bare number (``"17"``) is CHATBOT (observed 4 s to 60 s),
  ``"<n>_1"`` is TTS (every one's call text is "Convert this to text to speech."), and
  ``"<n>_2"`` / ``"<n>_3"`` is IMAGE (call text "Generate an image about this.").
- anything else is OTHER.

On the bundled file this gives 103 MATH, 54 VE, 45 QA, 65 CHATBOT, 65 TTS and 65 IMAGE.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from marsched.workload._checks import (
    DuplicateKey,
    Source,
    decode_utf8,
    no_duplicate_keys,
    read_trace_bytes,
    require_count,
    require_seconds,
    require_text,
)
from marsched.workload.errors import TraceError, describe
from marsched.workload.model import ApiCall, ApiType, Request, build_request
from marsched.workload.tokenizer import count_tokens_batch

MATH_BELOW_S = 0.01
VE_BELOW_S = 0.2

_CHATBOT_ID = re.compile(r"\d+")
_TTS_ID = re.compile(r"\d+_1")
_IMAGE_ID = re.compile(r"\d+_[23]")


@dataclass(frozen=True, slots=True)
class _Encoding:
    prompt: str
    completion: str
    api_return: str
    check: Callable[..., int | str]  # validates prompt / completion / API-return values


_TOKENS = _Encoding("prompt_tokens", "completion_tokens", "api_token_length", require_count)
_TEXT = _Encoding("prompt", "completion", "api_token", require_text)


@dataclass(frozen=True, slots=True)
class _Draft:
    """A validated request whose lengths may still be text to count."""

    request_id: str
    prompt: int | str
    outputs: tuple[int | str, ...]
    calls: tuple[tuple[float, int | str], ...]  # (api_time, return) for every segment but the last
    text: bool


def api_type_for_duration(api_time_s: float) -> ApiType:
    """The API type of a token-count record's call, from its duration (see the module docstring)."""
    if api_time_s < MATH_BELOW_S:
        return ApiType.MATH
    if api_time_s < VE_BELOW_S:
        return ApiType.VE
    return ApiType.QA


def api_type_for_id(request_id: str) -> ApiType:
    """The API type of a text record's calls, from its request id (see the module docstring)."""
    if _CHATBOT_ID.fullmatch(request_id):
        return ApiType.CHATBOT
    if _TTS_ID.fullmatch(request_id):
        return ApiType.TTS
    if _IMAGE_ID.fullmatch(request_id):
        return ApiType.IMAGE
    return ApiType.OTHER


def load_infercept_json(path: str | os.PathLike[str]) -> list[Request]:
    """Read an INFERCEPT/MARS JSON trace; raises TraceError naming file, request, segment and field."""
    return parse_infercept_json(read_trace_bytes(path), source=path)


def parse_infercept_json(data: bytes | str, source: Source) -> list[Request]:
    """Parse the trace's content; `source` names it in errors."""
    document = _parse_document(decode_utf8(data, source), source)
    drafts = [_draft(request_id, segments, source) for request_id, segments in document.items()]
    counts = _count_texts(drafts)
    return [_build(draft, counts) for draft in drafts]


def _parse_document(text: str, source: Source) -> dict[str, object]:
    if not text.strip():
        raise TraceError(source, "file", None, "is empty (expected a JSON object of request id -> list of segments)")
    try:
        document = json.loads(text, object_pairs_hook=no_duplicate_keys)
    except DuplicateKey as duplicate:
        raise TraceError(
            source, "file", duplicate.key, "appears twice in one JSON object (a repeated request id or segment key)"
        ) from None
    except json.JSONDecodeError as error:
        where = f"line {error.lineno} column {error.colno}"
        raise TraceError(source, where, None, f"not valid JSON: {error.msg}") from None
    if not isinstance(document, dict):
        problem = "top level must be a JSON object of request id -> list of segments"
        raise TraceError(source, "file", None, f"{problem}, got {type(document).__name__}")
    if not document:
        raise TraceError(source, "file", None, "contains no requests")
    return document


def _draft(request_id: str, segments: object, source: Source) -> _Draft:
    where = f"request {request_id!r}"
    if not isinstance(segments, list):
        raise TraceError(source, where, None, f"must be a list of segments, got {describe(segments)}")
    if not segments:
        raise TraceError(source, where, None, "has no segments")
    for index, segment in enumerate(segments):
        if not isinstance(segment, dict):
            raise TraceError(source, f"{where} segment {index}", None, f"must be a JSON object, got {describe(segment)}")
    encoding = _encoding_of(segments[0], source, f"{where} segment 0")

    def get(segment: dict, index: int, key: str, check: Callable[..., object]) -> object:
        if key not in segment:
            raise TraceError(source, f"{where} segment {index}", key, "missing")
        return check(segment[key], source, f"{where} segment {index}", key)

    prompt = get(segments[0], 0, encoding.prompt, encoding.check)
    outputs: list[int | str] = []
    calls: list[tuple[float, int | str]] = []
    context = prompt if encoding is _TOKENS else None
    for index, segment in enumerate(segments):
        last = index == len(segments) - 1
        if index > 0 and encoding.prompt in segment:
            given = encoding.check(segment[encoding.prompt], source, f"{where} segment {index}", encoding.prompt)
            if context is not None and given != context:
                raise TraceError(
                    source,
                    f"{where} segment {index}",
                    encoding.prompt,
                    f"is {given} but the previous segment implies {context} (its prompt + completion + API return)",
                )
        outputs.append(get(segment, index, encoding.completion, encoding.check))
        if last:
            for key in ("api_time", encoding.api_return):
                if key in segment:
                    raise TraceError(source, f"{where} segment {index}", key, "the last segment cannot have an API call")
            continue
        api_time = get(segment, index, "api_time", require_seconds)
        api_return = get(segment, index, encoding.api_return, encoding.check)
        calls.append((api_time, api_return))
        if context is not None:
            context += outputs[-1] + api_return
    return _Draft(request_id, prompt, tuple(outputs), tuple(calls), text=encoding is _TEXT)


def _encoding_of(segment: dict, source: Source, where: str) -> _Encoding:
    has_tokens, has_text = _TOKENS.prompt in segment, _TEXT.prompt in segment
    if has_tokens and has_text:
        raise TraceError(source, where, _TEXT.prompt, "present together with 'prompt_tokens'; a segment uses one encoding")
    if has_tokens:
        return _TOKENS
    if has_text:
        return _TEXT
    raise TraceError(source, where, _TOKENS.prompt, "missing (segment 0 needs 'prompt_tokens' or, as text, 'prompt')")


def _count_texts(drafts: Sequence[_Draft]) -> dict[str, int]:
    texts = {value for d in drafts if d.text for value in (d.prompt, *d.outputs, *(r for _, r in d.calls))}
    unique = sorted(texts)
    return dict(zip(unique, count_tokens_batch(unique)))


def _build(draft: _Draft, counts: dict[str, int]) -> Request:
    def tokens(value: int | str) -> int:
        return counts[value] if isinstance(value, str) else value

    parts: list[tuple[int, ApiCall | None]] = []
    for index, output in enumerate(draft.outputs):
        api = None
        if index < len(draft.calls):
            api_time, api_return = draft.calls[index]
            api_type = api_type_for_id(draft.request_id) if draft.text else api_type_for_duration(api_time)
            api = ApiCall(api_type, api_time, tokens(api_return))
        parts.append((tokens(output), api))
    return build_request(draft.request_id, tokens(draft.prompt), parts)

"""The INFERCEPT/MARS JSON trace: an object of request id -> list of segments.

Two encodings:

- token counts: ``prompt_tokens``, ``completion_tokens``, ``api_time`` (s), ``api_token_length``;
- text: ``prompt``, ``completion``, ``api_time`` (s), ``api_token``, counted with the GPT-2
  tokenizer (GPT-J's), see `marsched.workload.tokenizer`.

A request's encoding is the one its segment 0 uses. Only segment 0's prompt is new input;
later contexts are derived (previous context + output + API return), so later ``prompt``
texts are never tokenized. A later ``prompt_tokens`` that is present must agree with the
derived context: a file that disagrees describes a different model of the request, and
simulating it silently would be wrong. Keys other than these are ignored. Requests keep
the file's order; arrival is 0.

Which segments end with an API call. INFERCEPT's benchmark reads a segment as having a
call when it has ``api_time``, unless ``api_time`` and the return are both 0. The
published files agree with the simpler rule we apply: every segment but the last has
``api_time`` and a return and ends with a call (``api_time`` 0 with a return is a call
of zero duration: 5 MATH calls in the single-API file, 15 in the multi-API one). The last
segment ends with a call (a *trailing call*, see `Request`) when it has ``api_time`` or the
return key, and then needs both; the single-API file has none, the multi-API file 184
(the 130 text records of the TTS and image families, and the 54 VE token-count records). A
last segment whose call takes 0 s and returns nothing is read as having no call, as
INFERCEPT does; no published segment is like that. Between segments, a 0 s call that
returns nothing is kept, because our requests need a call to separate two segments.

Negative returns. Four segments of the multi-API file (the trailing calls of requests
``7_2``, ``13_2``, ``16_2`` and ``25``, segment 5) have ``api_token_length`` -2.
INFERCEPT appends that many placeholder tokens, which for a negative number is none, so
by default we read such a return as 0 and emit one `TraceWarning` per file that says how
many segments were read so and names the first few. ``strict=True`` raises a TraceError
for the first one instead. The check of later ``prompt_tokens`` uses the file's own
numbers, before the return is read as 0.

API types are not stored in the file. They are labelled from the data as follows:

- token-count records, per call, by its ``api_time``: below 0.01 s is MATH (observed
  0 s to 6e-4 s), 0.01 s up to 0.2 s is VE (observed 0.052 s to 0.111 s), 0.2 s and above
  is QA (observed 0.275 s to 1.03 s). The gaps between the groups are two orders of
  magnitude and a factor of 2.5, so the thresholds sit well clear of every record, in
  both files.
- text records, per call, by the call's text and the request id: the call text "Convert
  this to text to speech." is TTS, "Generate an image about this." is IMAGE, any other
  call text is the user's next chat turn, CHATBOT, when the request id is of the chat
  family (`api_type_for_id`: ``"17"``, ``"17_1"``, ``"17_2"``, ``"17_3"``), and OTHER
  otherwise. In the single-API file this is the same as labelling by id (a bare number
  is CHATBOT, ``"<n>_1"`` TTS, ``"<n>_2"``/``"<n>_3"`` IMAGE). In the multi-API file the
  TTS and image records alternate their instruction with chat turns, so labelling by id
  alone would call 225 chat turns TTS and 225 IMAGE.

Counts of calls per type, and the durations observed:

| type | single-API (397 calls) | multi-API (1841 calls) |
| --- | --- | --- |
| MATH | 103, 0 s to 6.0e-4 s | 283, 0 s to 6.0e-4 s |
| VE | 54, 0.052 s to 0.111 s | 289, 0.052 s to 0.111 s |
| QA | 45, 0.275 s to 0.994 s | 144, 0.275 s to 1.03 s |
| CHATBOT | 65, 4.0 s to 60 s | 675, 3.1 s to 60 s |
| TTS | 65, 1.3 s to 12.1 s | 225, 0.08 s to 13.0 s |
| IMAGE | 65, 9.4 s to 13.5 s | 225, 9.2 s to 13.6 s |
| OTHER | 0 | 0 |

(The multi-API TTS calls are shorter at times because some texts to speak are short.)
"""

from __future__ import annotations

import json
import os
import re
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

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
from marsched.workload.errors import TraceError, TraceWarning, describe
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
    check: Callable[..., int | str]  # validates prompt and completion values
    check_return: Callable[..., int | str]  # validates the API return (a negative count is dealt with later)


def _require_int(value: object, source: Source, record: str, field: str) -> int:
    """An integer that may be negative: the published multi-API file has returns of -2 (see the docstring)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TraceError(source, record, field, f"must be an integer, got {describe(value)}")
    return value


_TOKENS = _Encoding("prompt_tokens", "completion_tokens", "api_token_length", require_count, _require_int)
_TEXT = _Encoding("prompt", "completion", "api_token", require_text, require_text)

# A text record's call whose text is one of these instructions is that augmentation (compared
# after stripping and case folding; the files end them with a space).
_TTS_INSTRUCTION = "convert this to text to speech."
_IMAGE_INSTRUCTION = "generate an image about this."


@dataclass(frozen=True, slots=True)
class _Draft:
    """A validated request whose lengths may still be text to count."""

    request_id: str
    prompt: int | str
    outputs: tuple[int | str, ...]
    calls: tuple[tuple[float, int | str] | None, ...]  # per segment: (api_time, return), or None for no call
    text: bool


def api_type_for_duration(api_time_s: float) -> ApiType:
    """The API type of a token-count record's call, from its duration (see the module docstring)."""
    if api_time_s < MATH_BELOW_S:
        return ApiType.MATH
    if api_time_s < VE_BELOW_S:
        return ApiType.VE
    return ApiType.QA


def api_type_for_id(request_id: str) -> ApiType:
    """The augmentation a text record was built for, from its request id (see the module docstring)."""
    if _CHATBOT_ID.fullmatch(request_id):
        return ApiType.CHATBOT
    if _TTS_ID.fullmatch(request_id):
        return ApiType.TTS
    if _IMAGE_ID.fullmatch(request_id):
        return ApiType.IMAGE
    return ApiType.OTHER


def api_type_for_text_call(request_id: str, call_text: str) -> ApiType:
    """The API type of one call of a text record, from the call's text and the request id.

    The TTS and image instructions name their augmentation. Any other call text in a
    record of the chat family (any id `api_type_for_id` recognises) is the user's next
    chat turn, so the call is CHATBOT; in an unrecognised record it is OTHER.
    """
    instruction = call_text.strip().casefold()
    if instruction == _TTS_INSTRUCTION:
        return ApiType.TTS
    if instruction == _IMAGE_INSTRUCTION:
        return ApiType.IMAGE
    return ApiType.OTHER if api_type_for_id(request_id) is ApiType.OTHER else ApiType.CHATBOT


def load_infercept_json(path: str | os.PathLike[str], *, strict: bool = False) -> list[Request]:
    """Read an INFERCEPT/MARS JSON trace; raises TraceError naming file, request, segment and field.

    Without `strict`, a negative ``api_token_length`` is read as 0 and reported in one
    TraceWarning for the whole file; with `strict` it is a TraceError.
    """
    return parse_infercept_json(read_trace_bytes(path), source=path, strict=strict)


def parse_infercept_json(data: bytes | str, source: Source, *, strict: bool = False) -> list[Request]:
    """Parse the trace's content; `source` names it in errors and warnings. `strict` as in `load_infercept_json`."""
    document = _parse_document(decode_utf8(data, source), source)
    clamped: list[str] = []
    drafts = [_draft(request_id, segments, source, strict, clamped) for request_id, segments in document.items()]
    counts = _count_texts(drafts)
    requests = [_build(draft, counts) for draft in drafts]
    if clamped:
        # One warning per file, after everything parsed: a file that fails later must not warn first.
        warning = TraceWarning(source, _TOKENS.api_return, tuple(clamped), "< 0 read as 0, as INFERCEPT does")
        warnings.warn(warning, stacklevel=2)
    return requests


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


def _draft(request_id: str, segments: object, source: Source, strict: bool, clamped: list[str]) -> _Draft:
    """Validate one request; records whose negative return is read as 0 are appended to `clamped`."""
    where = f"request {request_id!r}"
    if not isinstance(segments, list):
        raise TraceError(source, where, None, f"must be a list of segments, got {describe(segments)}")
    if not segments:
        raise TraceError(source, where, None, "has no segments")
    for index, segment in enumerate(segments):
        if not isinstance(segment, dict):
            raise TraceError(source, f"{where} segment {index}", None, f"must be a JSON object, got {describe(segment)}")
    encoding = _encoding_of(segments[0], source, f"{where} segment 0")

    def get(segment: dict, record: str, key: str, check: Callable[..., object]) -> object:
        if key not in segment:
            raise TraceError(source, record, key, "missing")
        return check(segment[key], source, record, key)

    prompt = get(segments[0], f"{where} segment 0", encoding.prompt, encoding.check)
    outputs: list[int | str] = []
    calls: list[tuple[float, int | str] | None] = []
    context = prompt if encoding is _TOKENS else None
    for index, segment in enumerate(segments):
        record = f"{where} segment {index}"
        last = index == len(segments) - 1
        if index > 0 and encoding.prompt in segment:
            given = encoding.check(segment[encoding.prompt], source, record, encoding.prompt)
            if context is not None and given != context:
                raise TraceError(
                    source,
                    record,
                    encoding.prompt,
                    f"is {given} but the previous segment implies {context} (its prompt + completion + API return)",
                )
        outputs.append(get(segment, record, encoding.completion, encoding.check))
        call = _call_of(segment, record, last, encoding, source)
        if call is None:
            calls.append(None)
            continue
        api_time, api_return = call
        if context is not None:
            context += outputs[-1] + api_return  # the file's own arithmetic, before any clamping
        if isinstance(api_return, int) and api_return < 0:
            if strict:
                problem = f"must be >= 0, got {api_return} (strict loading; otherwise read as 0 with a warning)"
                raise TraceError(source, record, encoding.api_return, problem)
            clamped.append(f"{record} ({api_return})")
            api_return = 0
        if last and api_time == 0 and api_return in (0, ""):
            # INFERCEPT's rule: a segment whose call takes no time and returns nothing has no call.
            # Only the last segment can drop it; between segments a call must stay to split them.
            calls.append(None)
            continue
        calls.append((api_time, api_return))
    return _Draft(request_id, prompt, tuple(outputs), tuple(calls), text=encoding is _TEXT)


def _call_of(
    segment: dict, record: str, last: bool, encoding: _Encoding, source: Source
) -> tuple[float, int | str] | None:
    """The segment's (api_time, return) as the file gives them, or None if it ends without a call.

    Every segment but the last ends with a call. The last ends with one (a trailing call)
    when it has either call key; then it needs both, as the others do.
    """
    why = ""
    if last:
        present = [key for key in ("api_time", encoding.api_return) if key in segment]
        if not present:
            return None
        why = f" (the last segment has {present[0]!r}, so it ends with an API call)"
    for key in ("api_time", encoding.api_return):
        if key not in segment:
            raise TraceError(source, record, key, "missing" + why)
    api_time = require_seconds(segment["api_time"], source, record, "api_time")
    return api_time, encoding.check_return(segment[encoding.api_return], source, record, encoding.api_return)


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
    texts = {
        value
        for d in drafts
        if d.text
        for value in (d.prompt, *d.outputs, *(call[1] for call in d.calls if call is not None))
    }
    unique = sorted(texts)
    return dict(zip(unique, count_tokens_batch(unique)))


def _build(draft: _Draft, counts: dict[str, int]) -> Request:
    def tokens(value: int | str) -> int:
        return counts[value] if isinstance(value, str) else value

    parts: list[tuple[int, ApiCall | None]] = []
    for output, call in zip(draft.outputs, draft.calls):
        api = None
        if call is not None:
            api_time, api_return = call
            if draft.text:
                api_type = api_type_for_text_call(draft.request_id, api_return)
            else:
                api_type = api_type_for_duration(api_time)
            api = ApiCall(api_type, api_time, tokens(api_return))
        parts.append((tokens(output), api))
    request = build_request(draft.request_id, tokens(draft.prompt), parts)
    # Each INFERCEPT request comes from one augmentation's data set, which its prompt shows (a
    # math question, a chat, a TTS task): the class a server knows before the first call.
    first_call = next(s.api for s in request.segments if s.api is not None) if request.num_calls else None
    return replace(request, task_class=first_call.api_type.value if first_call else "")

"""The OpenAI request fields users send, valid and not, drawn at random: the fuzz's requests.

`draw_fields` picks a few of `FIELDS` with a value each, from the values a client might send:
the ordinary ones, the extremes and the wrong types. `verdict` says whether the server's
answer is one a serving system owes such a request: a 2xx, or a 4xx whose error names one
of the fields sent (a 5xx, a dropped connection or an unexplained 4xx is a fault).
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from typing import Any

# A client-side tool whose enum-constrained arguments the random-weight model fills under xgrammar.
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["paris", "oslo"]}},
                   "required": ["city"], "additionalProperties": False}}}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}

# Per field: the values a client may send. Chat-only and completions-only values are keyed by endpoint.
_BOTH: dict[str, list[Any]] = {
    "seed": [0, 7, -1, 2**64, "7", None],
    "n": [1, 2, 3, 0, -1, "2", 1.5, None],
    "stop": ["\n", ["the", "a"], [], "", ["x"] * 5, 5, [1, 2], None],
    "response_format": [{"type": "text"}, {"type": "json_object"},
                        {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}},
                        {"type": "json_schema"}, {"type": "bogus"}, "json", None],
    "max_tokens": [1, 4, 16, 64, 0, -1, 2**31, 10**30, "8", 1.5, None],
    "stream": [True, False, "yes", None],
    "stream_options": [{"include_usage": True}, {"include_usage": False, "continuous_usage_stats": True},
                       {"include_usage": "maybe"}, "on", None],
    "temperature": [0, 0.7, 2.5, -1, "hot", None],
}
_CHAT: dict[str, list[Any]] = {
    "logprobs": [True, False, 3, "yes", None],
    "top_logprobs": [0, 2, 20, 21, -1, "a", None],
    "tools": [[WEATHER], [], [{"type": "function"}], "calculator",
              [{"type": "function", "function": {"name": "f", "parameters": "x"}}], None],
    "tool_choice": ["none", "auto", "required", {"type": "function", "function": {"name": "get_weather"}},
                    {"type": "function", "function": {"name": "missing"}}, "always", 3, None],
}
_COMPLETIONS: dict[str, list[Any]] = {
    "logprobs": [0, 1, 5, 20, 21, -1, True, "x", None],
}
FIELDS = tuple(sorted({*_BOTH, *_CHAT, *_COMPLETIONS}))
CHAT_PATH, COMPLETIONS_PATH = "/v1/chat/completions", "/v1/completions"


def draw_fields(rng: random.Random, path: str, most: int = 4) -> dict[str, Any]:
    """One to `most` fields of `path`'s endpoint, each with a value drawn from its list."""
    table = {**_BOTH, **(_CHAT if path == CHAT_PATH else _COMPLETIONS)}
    names = rng.sample(sorted(table), rng.randint(1, most))
    return {name: rng.choice(table[name]) for name in names}


def fuzz_body(rng: random.Random, model: str, path: str | None = None) -> tuple[str, dict[str, Any]]:
    """(endpoint, request body): a short prompt and drawn fields (`draw_fields`)."""
    path = path or rng.choice((CHAT_PATH, COMPLETIONS_PATH))
    if path == CHAT_PATH:
        body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": "the weather in oslo"}]}
    else:
        body = {"model": model, "prompt": "the quick brown fox"}
    body["max_tokens"] = 8
    body.update(draw_fields(rng, path))
    return path, body


@dataclass(frozen=True, slots=True)
class Verdict:
    ok: bool
    why: str  # "2xx"; "4xx names FIELD"; or what is wrong


def verdict(status: int, text: str, sent: dict[str, Any]) -> Verdict:
    """Whether (`status`, response `text`) is a fair answer to a request that sent the fields `sent`.

    A streamed answer is 200 even when vLLM refuses the request after it started: the refusal is a
    `data: {"error": ...}` event. It is judged like a non-streamed error with that event's code."""
    if 200 <= status < 300:
        error = _stream_error(text)
        if error is None:
            return Verdict(True, "2xx")
        status, text = error
    if 400 <= status < 500:
        field = _named(text, sent)
        if field is not None:
            return Verdict(True, f"4xx names {field}")
        return Verdict(False, f"{status} names none of {sorted(sent)}: {text[:300]}")
    return Verdict(False, f"{status}: {text[:300]}")


def _named(text: str, sent: dict[str, Any]) -> str | None:
    try:
        error = json.loads(text).get("error") or {}
        said = f"{error.get('param') or ''} {error.get('message') or ''}".lower()
    except (ValueError, AttributeError):
        said = text.lower()
    for name in sorted(sent, key=len, reverse=True):  # top_logprobs before logprobs
        spellings = {name, name.replace("_", " ")}
        if any(re.search(rf"(?<![a-z_]){re.escape(s)}(?![a-z_])", said) for s in spellings):
            return name
    return None


def _stream_error(text: str) -> tuple[int, str] | None:
    """The (code, event) of the first error event of a streamed response, if it has one."""
    for line in text.splitlines():
        if not line.startswith("data: {"):
            continue
        try:
            event = json.loads(line[len("data: "):])
        except ValueError:
            continue
        error = event.get("error") if isinstance(event, dict) else None
        if isinstance(error, dict):
            code = error.get("code")
            return (code if isinstance(code, int) else 500), json.dumps(event)
    return None

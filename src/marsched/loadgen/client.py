"""The load generator's HTTP client: the server's model, a probe turn, and one streamed turn.

Turns go to ``POST /v1/completions`` with ``stream: true`` and ``stream_options:
{"include_usage": true}``, through the official `openai` client, so any OpenAI-compatible
server answers them. Each carries, in ``vllm_xargs`` (vLLM's field for extra sampling
arguments; a server that does not know a key ignores it):

- ``marsched_bench_reply_tokens``: the reply length to force (`marsched.loadgen.reply_target`),
  read only by the bench's logits processor;
- ``marsched``: ``{"conversation": "<id>"}`` with conversation keys on, so that a marsched
  server knows the turns of one conversation (`marsched.vllm.metadata`). Nothing else: the
  scheduler learns about a turn what a real agent would tell it.

``max_tokens`` is the same fixed cap for every turn (vLLM lowers it to what the context
leaves): the scheduler reads ``max_tokens`` as a request's planned length, so it must not
carry the reply's length. No ``seed`` (it crashes vLLM's CPU engine), no ``ignore_eos``.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from marsched.loadgen.records import TurnRecord
from marsched.loadgen.reply_target import REPLY_TOKENS_KEY
from marsched.vllm.metadata import KEY as MARSCHED_KEY

PROBE_PROMPT = " the and to in is"
PROBE_TARGET = 3  # reply tokens the probe asks for
PROBE_MAX_TOKENS = 12
# Idle connections are dropped after this long, before vLLM's server closes them (its keep-alive,
# `VLLM_HTTP_TIMEOUT_KEEP_ALIVE`, is 5 s, as was the client's): with both at 5 s, a turn sent after a
# tool gap of about 5 s could go out on a connection the server was closing and get no answer.
KEEPALIVE_S = 2.0


class ServerError(Exception):
    """The server cannot be used: it does not answer, is not an OpenAI server, or refuses what we send."""


def base_url(url: str) -> str:
    """The server's root URL (a trailing ``/`` or ``/v1`` dropped); ValueError naming URL if it is not one."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"URL {url!r}: give the server's address, e.g. http://127.0.0.1:8000")
    try:
        parts.port  # noqa: B018 - raises on a port that is not a number
    except ValueError:
        raise ValueError(f"URL {url!r}: the port is not a number") from None
    root = url.strip().rstrip("/")
    return root[:-3] if root.endswith("/v1") else root


@dataclass(frozen=True, slots=True)
class ServerInfo:
    model: str
    models: tuple[str, ...]  # what /v1/models lists
    max_model_len: int | None  # vLLM lists it; None where the server does not say


def describe_error(error: BaseException, timeout_s: float | None = None) -> str:
    """One line saying what failed (HTTP status and the server's message, no answer, a timeout)."""
    from openai import APIConnectionError, APIStatusError, APITimeoutError

    if isinstance(error, APITimeoutError):
        return f"timed out after {timeout_s:g} s" if timeout_s else "timed out"
    if isinstance(error, APIConnectionError):
        cause = error.__cause__ or error
        return f"no answer ({type(cause).__name__}: {cause})"
    if isinstance(error, APIStatusError):
        message = error.message
        body = error.body
        if isinstance(body, dict):
            inner = body.get("error", body)
            message = inner.get("message", message) if isinstance(inner, dict) else str(inner)
        return _one_line(f"HTTP {error.status_code}: {message}")
    return _one_line(f"{type(error).__name__}: {error}")


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def open_client(url: str, timeout_s: float, api_key: str) -> Any:
    import httpx
    from openai import DEFAULT_CONNECTION_LIMITS, AsyncOpenAI, DefaultAsyncHttpxClient

    # The openai client's own pool sizes, with idle connections dropped at KEEPALIVE_S.
    limits = httpx.Limits(max_connections=DEFAULT_CONNECTION_LIMITS.max_connections,
                          max_keepalive_connections=DEFAULT_CONNECTION_LIMITS.max_keepalive_connections,
                          keepalive_expiry=KEEPALIVE_S)
    # No retries: a failed turn is a measurement, and a retry would hide it in the latency.
    return AsyncOpenAI(base_url=f"{url}/v1", api_key=api_key, timeout=timeout_s, max_retries=0,
                       http_client=DefaultAsyncHttpxClient(limits=limits))


async def server_info(client: Any, model: str | None) -> ServerInfo:
    """The model to use (`model`, or the first the server lists) and its context length; ServerError
    naming what is wrong."""
    try:
        page = await client.models.list()
    except Exception as error:  # noqa: BLE001 - every failure is one line for the user
        raise ServerError(f"GET {client.base_url}models: {describe_error(error)}") from None
    listed = [(entry.id, getattr(entry, "max_model_len", None)) for entry in page.data]
    if not listed:
        raise ServerError(f"GET {client.base_url}models: the server lists no model")
    names = tuple(name for name, _ in listed)
    chosen = model if model is not None else names[0]
    if chosen not in names:
        raise ServerError(f"--model {model}: the server does not serve it; it serves {', '.join(names)}")
    max_len = dict(listed)[chosen]
    return ServerInfo(chosen, names, max_len if isinstance(max_len, int) else None)


def turn_xargs(target: int, conversation: str | None, retain: bool = True,
               predicted: int | None = None) -> dict[str, Any]:
    """The turn's `vllm_xargs`: the target for the bench's processor, beside the scheduler's fields.
    `predicted` (a diagnostic, `--oracle-predictions`) tells the scheduler the reply's length as the
    client's own prediction: what MARS does with exact lengths."""
    xargs: dict[str, Any] = {REPLY_TOKENS_KEY: target}
    keys: dict[str, Any] = {}
    if conversation is not None:
        keys["conversation"] = conversation
        if not retain:
            keys["retain"] = False
    if predicted is not None:
        keys["predicted"] = predicted
    if keys:
        xargs[MARSCHED_KEY] = json.dumps(keys, separators=(",", ":"))
    return xargs


async def send_turn(client: Any, model: str, prompt: str, turn: TurnRecord, *, max_tokens: int,
                    conversation: str | None, clock0: float, timeout_s: float | None = None,
                    retain: bool = True, oracle: bool = False) -> str:
    """Send one streamed turn and fill `turn` (a failure is its `error`); return the reply's text."""
    pieces: list[str] = []
    started = time.monotonic()
    turn.sent_s = started - clock0
    try:
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=max_tokens, stream=True,
            stream_options={"include_usage": True},
            extra_body={"vllm_xargs": turn_xargs(turn.target_tokens, conversation, retain,
                                                 min(turn.target_tokens, max_tokens) if oracle else None)})
        async for chunk in stream:
            if chunk.usage is not None:
                turn.prompt_tokens = chunk.usage.prompt_tokens
                turn.completion_tokens = chunk.usage.completion_tokens
            for choice in chunk.choices:
                if turn.ttft_s is None:  # a chunk per token; its text may be empty (a partial character)
                    turn.ttft_s = time.monotonic() - started
                pieces.append(choice.text or "")
                if choice.finish_reason:
                    turn.finish_reason = choice.finish_reason
        turn.latency_s = time.monotonic() - started
    except Exception as error:  # noqa: BLE001 - a failed turn is a result, not the end of the run
        turn.error = describe_error(error, timeout_s)
    return "".join(pieces)


async def probe(client: Any, model: str, conversation_keys: bool, clock0: float) -> bool:
    """One unmeasured turn asking for a 3-token reply; whether the server forced that length.
    ServerError if the server refuses the turn (a field it rejects, an engine that is down)."""
    turn = TurnRecord(0, 0.0, PROBE_TARGET)
    await send_turn(client, model, PROBE_PROMPT, turn, max_tokens=PROBE_MAX_TOKENS,
                    conversation="loadgen-probe" if conversation_keys else None, clock0=clock0,
                    retain=False)  # a marsched server keeps nothing of it
    if turn.error is not None:
        hint = "; add --no-conversation-keys if it refuses vllm_xargs.marsched" if conversation_keys else ""
        raise ServerError(f"a probe turn failed: {turn.error}{hint}")
    return turn.completion_tokens == PROBE_TARGET and turn.finish_reason == "stop"

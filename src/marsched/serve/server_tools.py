"""Server-side tools on `POST /v1/chat/completions`: `marsched serve --tools FILE`.

An ASGI middleware in vLLM's API server (`--middleware
marsched.serve.server_tools.ServerToolsMiddleware`; the tools file's path comes in
`$MARSCHED_TOOLS`, `tool_config.py`). A non-streaming chat request whose `tools` list
names a registered tool (the client may send only the name; the registry's description
and parameters replace the entry) is run as a loop of internal requests to vLLM's app:

- a response whose message calls only server-side tools the request offers: the tools
  run (concurrently, each under its timeout; a failure, a timeout or a non-str result
  is the tool message `"error: ..."`, so the model sees it and the request goes on; a NUL
  or a lone surrogate in a result becomes U+FFFD),
  the assistant message and the tool messages are appended, and vLLM is asked again;
- anything else (no tool calls, a client-side tool among them, `max_rounds` reached, an
  error from vLLM) goes back to the client: one completion, `usage` summed over rounds.

A forced `tool_choice` ("required" or a named function) applies to the first round;
later rounds use "auto" (else the model could never answer). Every round carries
`vllm_xargs.marsched` with `conversation` (one id per client request, "srv-<uuid4 hex>",
unless the client sent one) and `tool_s` (the predicted seconds until the follow-up:
`DurationEstimate` of the tool), merged into the client's own object (its keys win).
When the loop ends, the KV the scheduler retains for the conversation is released at
once (`marsched.vllm.retention.send_release`), unless
the answer hands client-side tool calls back on a conversation id the client chose (the
client continues it). A client that disconnects stops the loop: vLLM sees the
disconnect, a running tool is cancelled (a sync function's thread runs to its end).

Bodies naming no server-side tool, malformed JSON and every other path pass through
byte for byte. `stream: true` or `n > 1` with a server-side tool is an HTTP 400.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from marsched.serve.asgi_body import post_body, replay_body
from marsched.serve.tool_config import ENV, ToolsConfig, load_tools_config
from marsched.vllm.retention import send_release
from marsched.vllm.tools import ToolError

PATH = "/v1/chat/completions"
KEY = "marsched"

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class DurationEstimate:
    """A tool's expected duration: the configured prior until it has run, then the mean of its runs."""

    prior_s: float
    runs: int = 0
    total_s: float = 0.0

    @property
    def seconds(self) -> float:
        return self.total_s / self.runs if self.runs else self.prior_s

    def observe(self, seconds: float) -> None:
        self.runs += 1
        self.total_s += max(0.0, seconds)


@dataclass(slots=True)
class Captured:
    """One internal request's response, as vLLM's app sent it."""

    status: int = 500
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""


@dataclass(slots=True)
class Loop:
    """What one client request's loop carries from round to round."""

    body: dict[str, Any]
    meta: dict[str, Any] | None  # the client's marsched object (None: unusable, sent on as it was)
    conversation: str | None
    client_conversation: bool
    offered: list[str]  # the server-side tools the request names
    usage: dict[str, Any] = field(default_factory=dict)


class ServerToolsMiddleware:
    def __init__(self, app: Any, config: ToolsConfig | None = None) -> None:
        self.app = app
        if config is None:
            path = os.environ.get(ENV)
            if not path:
                raise RuntimeError(f"ServerToolsMiddleware needs ${ENV} (the tools file; marsched serve --tools)")
            config = load_tools_config(path)
        self.config = config
        self.estimates = {name: DurationEstimate(spec.tool.expected_duration_s) for name, spec in config.tools.items()}

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        raw = await post_body(self.app, scope, receive, send, (PATH,))
        if raw is None:
            return
        loop = self._loop(raw)
        if loop is None:
            await self.app(scope, replay_body(raw, receive), send)
            return
        problem = _unsupported(loop.body)
        if problem:
            await _send_json(send, 400, _error(*problem), [])
            return
        disconnected = asyncio.Event()
        watcher = asyncio.create_task(_watch(receive, disconnected))
        try:
            await self._run(loop, scope, send, disconnected)
        finally:
            watcher.cancel()

    # --- the request --------------------------------------------------------------------------

    def _loop(self, raw: bytes) -> Loop | None:
        """The loop for this body, or None when it names no server-side tool (it passes through)."""
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError):
            return None
        if not isinstance(body, dict) or not isinstance(body.get("tools"), list):
            return None
        names = [_function_name(t) for t in body["tools"]]
        offered = [name for name in names if name in self.config.tools]
        if not offered:
            return None
        # The server runs these tools, so its description of them is the one the model reads.
        body["tools"] = [self.config.tools[n].openai() if n in offered else t for n, t in zip(names, body["tools"])]
        meta = _client_meta(body)
        own = meta.get("conversation") if meta is not None else None
        if meta is None:
            conversation = None  # vLLM's validator answers the client's bad value; nothing is retained
        elif isinstance(own, str):
            conversation = own
        else:
            conversation = "srv-" + uuid.uuid4().hex
        return Loop(body, meta, conversation, isinstance(own, str), offered)

    def _round_body(self, loop: Loop, messages: list[Any], first: bool) -> bytes:
        body = dict(loop.body, messages=messages)
        choice = body.get("tool_choice")
        if not first and (choice == "required" or isinstance(choice, dict)):
            body["tool_choice"] = "auto"
        if loop.meta is not None:
            meta = {"conversation": loop.conversation, "tool_s": round(self._tool_s(loop), 6), **loop.meta}
            xargs = body.get("vllm_xargs") if isinstance(body.get("vllm_xargs"), dict) else {}
            body["vllm_xargs"] = {**xargs, KEY: json.dumps(meta, separators=(",", ":"))}
        return json.dumps(body).encode()

    def _tool_s(self, loop: Loop) -> float:
        """Seconds until the follow-up if this round calls a tool: the named tool's estimate when
        tool_choice names one, else the mean over the server-side tools offered."""
        choice = loop.body.get("tool_choice")
        named = _function_name(choice) if isinstance(choice, dict) else None
        names = [named] if named in self.estimates else loop.offered
        return sum(self.estimates[n].seconds for n in names) / len(names)

    # --- the loop -----------------------------------------------------------------------------

    async def _run(self, loop: Loop, scope: dict[str, Any], send: Any, disconnected: asyncio.Event) -> None:
        messages = loop.body.get("messages")  # a list once vLLM has answered 200
        keep = False
        try:
            for index in range(self.config.max_rounds):
                captured = await self._downstream(scope, self._round_body(loop, messages, index == 0), disconnected)
                if disconnected.is_set():
                    return
                try:
                    response = json.loads(captured.body) if captured.status == 200 else None
                except (ValueError, UnicodeDecodeError):
                    response = None
                if not isinstance(response, dict):  # vLLM's error (or something unreadable): the client's answer
                    await send({"type": "http.response.start", "status": captured.status, "headers": captured.headers})
                    await send({"type": "http.response.body", "body": captured.body})
                    return
                _add(loop.usage, response.get("usage"))
                message, calls = _tool_calls(response)
                # Only the tools this request offers run: a call of another registered one goes back too.
                server_only = bool(calls) and all(_function_name(c) in loop.offered for c in calls)
                if not server_only or index == self.config.max_rounds - 1:
                    keep = bool(calls) and not server_only and loop.client_conversation
                    if loop.usage:
                        response["usage"] = loop.usage
                    await _send_json(send, 200, response, captured.headers)
                    return
                results = await self._run_tools(calls, disconnected)
                if results is None:
                    return
                messages = [*messages, _assistant(message, calls),
                            *({"role": "tool", "tool_call_id": c.get("id"), "content": r}
                              for c, r in zip(calls, results))]
        finally:
            if loop.conversation is not None and not keep:
                await _release(scope, loop.conversation)

    async def _downstream(self, scope: dict[str, Any], body: bytes, disconnected: asyncio.Event) -> Captured:
        """One internal request to vLLM's app; the client's disconnect is passed on to it."""
        headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() not in (b"content-length",
                                                                                    b"transfer-encoding")]
        inner = dict(scope, headers=[*headers, (b"content-length", str(len(body)).encode())])
        captured = Captured()

        async def disconnect() -> dict[str, Any]:
            await disconnected.wait()
            return {"type": "http.disconnect"}

        async def capture(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                captured.status, captured.headers = message["status"], list(message.get("headers", []))
            elif message["type"] == "http.response.body":
                captured.body += message.get("body", b"")

        await self.app(inner, replay_body(body, disconnect), capture)
        return captured

    async def _run_tools(self, calls: list[dict[str, Any]], disconnected: asyncio.Event) -> list[str] | None:
        """Every call's tool message content, or None if the client disconnected (the tools are cancelled)."""
        work = asyncio.gather(*(self._run_tool(call) for call in calls))
        gone = asyncio.ensure_future(disconnected.wait())
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        gone.cancel()
        if not work.done():
            work.cancel()
            try:
                await work
            except BaseException:  # noqa: BLE001 - the cancelled tools' own ends do not matter
                pass
            return None
        return work.result()

    async def _run_tool(self, call: dict[str, Any]) -> str:
        name = _function_name(call)
        arguments = call.get("function", {}).get("arguments")
        try:
            args = json.loads(arguments) if isinstance(arguments, str) else arguments
        except ValueError as error:
            return f"error: the arguments of {name!r} are not valid JSON ({error})"
        if not isinstance(args, dict):
            return f"error: the arguments of {name!r} must be a JSON object, got {arguments!r}"
        started = time.monotonic()
        try:
            result = await self.config.registry.call(name, args)
        except ToolError as error:
            result = error
        # A failure or a timeout took its time too (the follow-up came that late); a cancelled
        # call (the client left) tells nothing and is not counted.
        self.estimates[name].observe(time.monotonic() - started)
        if isinstance(result, ToolError):
            return f"error: {result}"
        if not isinstance(result, str):
            return f"error: tool {name!r} returned {type(result).__name__}, not a string"
        return readable(result)


# --- helpers ---------------------------------------------------------------------------------

# NUL and lone surrogates: vLLM's request validation refuses them, which would answer the client
# with a 400 for what a tool returned.
_UNREADABLE = re.compile("[\x00\ud800-\udfff]")


def readable(text: str) -> str:
    """A tool's result as the model can be given it: each NUL or lone surrogate becomes U+FFFD."""
    return _UNREADABLE.sub("\ufffd", text)


def _function_name(entry: Any) -> str | None:
    """The function name of a tools entry, a named tool_choice or a tool call."""
    function = entry.get("function") if isinstance(entry, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    return name if isinstance(name, str) else None


def _client_meta(body: dict[str, Any]) -> dict[str, Any] | None:
    """The client's vllm_xargs.marsched object ({} if none); None if it is not one we can add keys to."""
    xargs = body.get("vllm_xargs")
    if xargs is None:
        return {}
    if not isinstance(xargs, dict):
        return None
    value = xargs.get(KEY)
    if value is None:
        return {}
    try:
        meta = json.loads(value) if isinstance(value, str) else None
    except ValueError:
        return None
    return meta if isinstance(meta, dict) else None


def _unsupported(body: dict[str, Any]) -> tuple[str, str] | None:
    if body.get("stream"):
        return ("stream", "stream=true is not supported with server-side tools (marsched serve --tools); "
                          "send stream=false, or leave the server-side tools out of 'tools'")
    n = body.get("n")
    if n is not None and n != 1:
        return ("n", "n > 1 is not supported with server-side tools (marsched serve --tools)")
    return None


def _tool_calls(response: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    choices = response.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
    message = choice.get("message") if isinstance(choice.get("message"), dict) else {}
    calls = message.get("tool_calls")
    return message, [c for c in calls if isinstance(c, dict)] if isinstance(calls, list) else []


def _assistant(message: dict[str, Any], calls: list[dict[str, Any]]) -> dict[str, Any]:
    return {"role": "assistant", "content": message.get("content"),
            "tool_calls": [{"id": c.get("id"), "type": "function",
                            "function": {"name": _function_name(c), "arguments": c["function"].get("arguments")}}
                           for c in calls]}


def _add(total: dict[str, Any], usage: Any) -> None:
    """Sum the counts of `usage` into `total` (nested details too; non-counts keep the latest)."""
    if not isinstance(usage, dict):
        return
    for key, value in usage.items():
        if isinstance(value, int) and not isinstance(value, bool) and isinstance(total.get(key), int):
            total[key] += value
        elif isinstance(value, dict):
            nested = total.get(key) if isinstance(total.get(key), dict) else {}
            _add(nested, value)
            total[key] = nested
        else:
            total[key] = value


async def _release(scope: dict[str, Any], conversation: str) -> None:
    engine = getattr(getattr(scope.get("app"), "state", None), "engine_client", None)
    try:
        if engine is None:
            raise RuntimeError("no engine client on the app")
        await send_release(engine, conversation)
    except Exception as error:  # noqa: BLE001 - a failed release must not fail the answer
        logger.warning("marsched: could not release conversation %s: %s: %s", conversation,
                       type(error).__name__, error)


async def _watch(receive: Any, disconnected: asyncio.Event) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    disconnected.set()


def _error(param: str, message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": "BadRequestError", "param": param, "code": 400}}


async def _send_json(send: Any, status: int, body: dict[str, Any], headers: list[tuple[bytes, bytes]]) -> None:
    data = json.dumps(body).encode()
    kept = [(k, v) for k, v in headers if k.lower() not in (b"content-length", b"content-type")]
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()), *kept]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": data})

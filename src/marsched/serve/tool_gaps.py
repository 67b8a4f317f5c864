"""Which tools a conversation's chat turn called, told to the scheduler: its gap is learned per tool.

An ASGI middleware in vLLM's API server (`--middleware marsched.serve.tool_gaps.ToolGapsMiddleware`,
added by `marsched serve`). The scheduler predicts the gap between a conversation's turns (the
time the client's tool takes) per tool (`marsched.policy.retention.GapEstimator`), but it cannot
read text. This middleware watches the responses of `POST /v1/chat/completions` whose request
names a conversation (`vllm_xargs.marsched.conversation`, read by `affinity.turn_of`; not a last
turn, `retain: false`), and when the reply calls tools, sends their names to the engine core for
that conversation (`marsched.vllm.tool_hints.send_tool_hint`, on vLLM's abort path, to every
data-parallel rank).

A reply calls tools when one of its choices carries tool calls (`message.tool_calls`, or the
`delta.tool_calls` of a stream) and ends with `tool_calls`, or with `stop`, which is how vLLM and
OpenAI end a call of a named `tool_choice`; a reply cut at `length`, or an error, calls nothing.

The response passes through unchanged, byte for byte, and is not delayed: each message goes on
to the client before it is looked at, and the hint is sent after the last one, in a background
task; a failure to send it is logged. Streamed replies (`text/event-stream`) are read line by
line, and only the events that can hold a tool call are parsed as JSON; a non-streamed reply is
parsed once, at its end, if it mentions `tool_calls`. A reply beyond MAX_BODY_BYTES (or a stream
line beyond it) is not read.

`/v1/completions` has no structured tool calls. A client that uses it for a tool loop writes the
model's own chat template and reads the model's own call syntax from the text, which is exactly
what vLLM's tool-call parser reads on chat. So when the server has one (`--tool-call-parser`,
or the one `marsched serve` picks), each choice of a completion that ended by itself (`stop`, not
`length`) is given to that parser (`completion_tools.py`), and the calls it finds start the pause.
Nothing else about a completion is evidence of a call: a stop string the client set may as well
end the answer, and chat does not pause on an answer either. Without a parser, or for text the
parser reads no call in, a completion starts no pause; a client can still state its tool in the
next turn's `tool` field (`marsched.vllm.metadata`).

Requests naming no conversation, bodies that are not JSON or whose marsched field is malformed,
and every other path pass through as they came.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from marsched.serve.affinity import Turn
from marsched.serve.asgi_body import MESSAGES_PATH, RESPONSES_PATH, post_body, replay_body
from marsched.serve.completion_tools import ReadCalls, completion_calls

PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
MAX_BODY_BYTES = 8 << 20  # what is kept of a non-streamed reply, or of one line of a stream, to read it
HINT_TIMEOUT_S = 10.0
CALLS_TOOLS = ("tool_calls", "stop")  # finish reasons of a reply that calls tools (`stop`: a named tool_choice)

logger = logging.getLogger(__name__)


class Reply(str, Enum):
    """The shape of a reply, by its endpoint."""

    CHAT = "chat"  # choices[].message.tool_calls / delta.tool_calls, finish_reason tool_calls
    MESSAGES = "messages"  # content[] blocks of type tool_use, stop_reason tool_use
    RESPONSES = "responses"  # output[] items of type function_call
    COMPLETION = "completion"  # choices[].text, read by the server's tool-call parser


SHAPES = {PATH: Reply.CHAT, MESSAGES_PATH: Reply.MESSAGES, RESPONSES_PATH: Reply.RESPONSES,
          COMPLETIONS_PATH: Reply.COMPLETION}
MARKS = {Reply.CHAT: b"tool_calls", Reply.MESSAGES: b"tool_use", Reply.RESPONSES: b"function_call",
         Reply.COMPLETION: b'"text"'}


@dataclass(slots=True)
class ReplyWatch:
    """What one response shows of its tool calls, fed its ASGI messages as they go to the client."""

    shape: Reply = Reply.CHAT
    status: int = 0
    streamed: bool = False
    done: bool = False  # its last message went by
    unread: bool = False  # too large, or not what a reply of its shape looks like: no tools to tell
    read_calls: ReadCalls | None = None  # a completion's text -> the tools it calls (the server's parser)
    _buffer: bytearray = field(default_factory=bytearray)
    _names: dict[int, list[str]] = field(default_factory=dict)  # choice index -> the tools it called
    _finish: dict[int, str] = field(default_factory=dict)  # choice index -> its finish reason
    _texts: dict[int, list[str]] = field(default_factory=dict)  # choice index -> a completion's text, in pieces

    def feed(self, message: dict[str, Any]) -> None:
        """Never raises: a response we cannot read is one we tell nothing about."""
        try:
            self._feed(message)
        except Exception:  # noqa: BLE001
            self.unread = True
            self._buffer.clear()

    def tools(self) -> list[str]:
        """The tools the reply called, in order (several choices: all of them); [] when none."""
        if self.unread or not self.done or self.status != 200:
            return []
        if self.shape is Reply.RESPONSES:  # a function_call item is a call; the reply ends there
            return self._names.get(0, [])
        if self.shape is Reply.COMPLETION:
            return self._completion_tools()
        calls = CALLS_TOOLS if self.shape is Reply.CHAT else ("tool_use",)
        return [name for index, names in sorted(self._names.items())
                if self._finish.get(index) in calls for name in names]

    def _feed(self, message: dict[str, Any]) -> None:
        kind = message.get("type")
        if kind == "http.response.start":
            self.status = int(message.get("status", 0))
            self.streamed = any(k.lower() == b"content-type" and v.lower().startswith(b"text/event-stream")
                                for k, v in message.get("headers", ()))
            return
        if kind != "http.response.body" or self.done:
            return
        self.done = not message.get("more_body", False)
        if self.unread or self.status != 200:
            return
        self._buffer += message.get("body", b"")
        if self.streamed:
            self._read_lines()
        elif len(self._buffer) > MAX_BODY_BYTES:
            self.unread = True
            self._buffer.clear()
        elif self.done:
            body = bytes(self._buffer)
            self._buffer.clear()
            if MARKS[self.shape] in body:
                self._read_reply(json.loads(body))

    def _read_lines(self) -> None:
        """Server-sent events, one `data:` line each (vLLM's); a line may span body messages."""
        mark = MARKS[self.shape]
        while True:
            end = self._buffer.find(b"\n")
            if end < 0 and self.done and self._buffer:
                end = len(self._buffer)  # the stream's last line, without its newline
            if end < 0:
                if len(self._buffer) > MAX_BODY_BYTES:
                    self.unread = True
                    self._buffer.clear()
                return
            line = bytes(self._buffer[:end]).strip()
            del self._buffer[:end + 1]
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            # Only a tool call's events, and the finish of a choice that made one, need reading.
            if mark in data or ((self._names or self._texts) and b"finish_reason" in data):
                self._read_chunk(json.loads(data))

    def _read_chunk(self, chunk: Any) -> None:
        if not isinstance(chunk, dict):
            return
        if self.shape is Reply.MESSAGES:  # content_block_start names a tool_use; message_delta ends it
            block = chunk.get("content_block")
            if isinstance(block, dict):
                self._block(block)
            delta = chunk.get("delta")
            if isinstance(delta, dict) and isinstance(delta.get("stop_reason"), str):
                self._finish[0] = delta["stop_reason"]
            return
        if self.shape is Reply.RESPONSES:  # each output item once, when it is done
            if chunk.get("type") == "response.output_item.done" and isinstance(chunk.get("item"), dict):
                self._item(chunk["item"])
            return
        if self.shape is Reply.COMPLETION:  # each chunk carries the next piece of each choice's text
            for index, choice in _choices(chunk):
                self._text(index, choice)
            return
        for index, choice in _choices(chunk):
            delta = choice.get("delta")
            self._note(index, delta.get("tool_calls") if isinstance(delta, dict) else None, choice)

    def _read_reply(self, reply: Any) -> None:
        if not isinstance(reply, dict):
            return
        if self.shape is Reply.MESSAGES:
            for block in reply.get("content") or ():
                if isinstance(block, dict):
                    self._block(block)
            if isinstance(reply.get("stop_reason"), str):
                self._finish[0] = reply["stop_reason"]
            return
        if self.shape is Reply.RESPONSES:
            for item in reply.get("output") or ():
                if isinstance(item, dict):
                    self._item(item)
            return
        if self.shape is Reply.COMPLETION:
            for index, choice in _choices(reply):
                self._text(index, choice)
            return
        for index, choice in _choices(reply):
            message = choice.get("message")
            self._note(index, message.get("tool_calls") if isinstance(message, dict) else None, choice)

    def _text(self, index: int, choice: dict[str, Any]) -> None:
        text = choice.get("text")
        if isinstance(text, str) and text:
            self._texts.setdefault(index, []).append(text)
        finish = choice.get("finish_reason")
        if isinstance(finish, str):
            self._finish[index] = finish

    def _completion_tools(self) -> list[str]:
        """The tools the server's parser reads in each choice that ended by itself (not cut at length)."""
        if self.read_calls is None:
            return []
        return [name for index, pieces in sorted(self._texts.items()) if self._finish.get(index) == "stop"
                for name in self.read_calls("".join(pieces))]

    def _block(self, block: dict[str, Any]) -> None:
        if block.get("type") == "tool_use" and isinstance(block.get("name"), str) and block["name"]:
            self._names.setdefault(0, []).append(block["name"])

    def _item(self, item: dict[str, Any]) -> None:
        if item.get("type") == "function_call" and isinstance(item.get("name"), str) and item["name"]:
            self._names.setdefault(0, []).append(item["name"])

    def _note(self, index: int, calls: Any, choice: dict[str, Any]) -> None:
        for call in calls if isinstance(calls, list) else ():
            function = call.get("function") if isinstance(call, dict) else None
            name = function.get("name") if isinstance(function, dict) else None
            if isinstance(name, str) and name:  # a stream names each call in its first delta only
                self._names.setdefault(index, []).append(name)
        finish = choice.get("finish_reason")
        if isinstance(finish, str):
            self._finish[index] = finish


def _choices(body: Any) -> list[tuple[int, dict[str, Any]]]:
    choices = body.get("choices") if isinstance(body, dict) else None
    found = []
    for position, choice in enumerate(choices if isinstance(choices, list) else ()):
        if isinstance(choice, dict):
            index = choice.get("index")
            found.append((index if isinstance(index, int) else position, choice))
    return found


def request_of(raw: bytes) -> tuple[Turn | None, str | None]:
    """The conversation a body names (None: none, or a last turn's) and its `rid`, the name the
    front end gave it (`prediction.py`)."""
    from marsched.vllm.metadata import KEY, MetadataError, parse

    try:
        body = json.loads(raw)
        xargs = body.get("vllm_xargs") if isinstance(body, dict) else None
        meta = parse(xargs.get(KEY)) if isinstance(xargs, dict) else None
    except (ValueError, UnicodeDecodeError, RecursionError, MetadataError):
        return None, None
    if meta is None:
        return None, None
    turn = Turn(meta.conversation, not meta.retain) if meta.conversation is not None else None
    return turn, meta.request_id


class ToolGapsMiddleware:
    def __init__(self, app: Any) -> None:
        self.app = app
        self._hints: set[asyncio.Task] = set()  # sent in the background; held until done

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        raw = await post_body(self.app, scope, receive, send, tuple(SHAPES))
        if raw is None:
            return
        turn, rid = request_of(raw) if b"vllm_xargs" in raw else (None, None)
        if (turn is None and rid is None) or (turn is not None and turn.last):  # nothing to tell, or no follow-up
            await self.app(scope, replay_body(raw, receive), send)
            return
        shape = SHAPES[scope["path"]]
        read_calls = completion_calls(scope) if shape is Reply.COMPLETION else None
        if shape is Reply.COMPLETION and read_calls is None:  # no parser: a completion's text says nothing
            await self.app(scope, replay_body(raw, receive), send)
            return
        watch = ReplyWatch(shape, read_calls=read_calls)

        async def watching(message: dict[str, Any]) -> None:
            await send(message)  # the client's first
            if watch.done:
                return
            watch.feed(message)
            if watch.done:
                tools = watch.tools()
                if tools:
                    self._hint(scope, turn, rid, tools)

        await self.app(scope, replay_body(raw, receive), watching)

    def _hint(self, scope: dict[str, Any], turn: Turn | None, rid: str | None, tools: list[str]) -> None:
        engine = getattr(getattr(scope.get("app"), "state", None), "engine_client", None)
        task = asyncio.create_task(_send_hint(engine, turn.conversation if turn is not None else None, rid, tools))
        self._hints.add(task)
        task.add_done_callback(self._hints.discard)


async def _send_hint(engine: Any, conversation: str | None, rid: str | None, tools: list[str]) -> None:
    """A named conversation's hint goes by its id; another request's by its rid: its conversation,
    if any, is known in the engine core only (`marsched.vllm.follow_ups`)."""
    from marsched.vllm.tool_hints import send_called, send_tool_hint

    try:
        if engine is None:
            raise RuntimeError("no engine client on the app")
        sending = (send_tool_hint(engine, conversation, tools) if conversation is not None
                   else send_called(engine, rid, tools))
        await asyncio.wait_for(sending, HINT_TIMEOUT_S)
    except Exception as error:  # noqa: BLE001 - a hint only sharpens a prediction; the reply has gone
        logger.warning("marsched: could not tell the scheduler the tools %s called (%s): %s: %s",
                       f"conversation {conversation}" if conversation is not None else f"request {rid}",
                       ", ".join(tools), type(error).__name__, error)

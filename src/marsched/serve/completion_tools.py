"""The tools a completion's text calls, read by the server's own tool-call parser (`tool_gaps.py`).

vLLM's chat endpoint reads a model's calls from its text with the parser the server was started
with (`--tool-call-parser`, or the one `marsched serve` picks, `tool_parser.py`). A client on
`/v1/completions` that writes the chat template itself gets the same text, so the same parser,
kept by vLLM's chat serving object (`app.state.openai_serving_chat.parser_cls`), reads it here.
It is built once per app, with no tools: the names it returns are the model's.

Parsers that run as an engine-side adapter (harmony's) do not read finished text; for them, and
for a server with no parser or no chat serving object, a completion calls nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

ReadCalls = Callable[[str], list[str]]
STATE_KEY = "marsched_completion_tools"  # the reader, on vLLM's app.state; None when there is none

logger = logging.getLogger(__name__)


def completion_calls(scope: dict[str, Any]) -> ReadCalls | None:
    """The app's reader of calls in a completion's text, built at its first use; None without a parser."""
    state = getattr(scope.get("app"), "state", None)
    if state is None:
        return None
    if hasattr(state, STATE_KEY):
        return getattr(state, STATE_KEY)
    serving = getattr(state, "openai_serving_chat", None)
    if serving is None:
        return None  # not ready yet, or no chat endpoint: looked at again at the next completion
    reader = None
    try:
        reader = _reader(serving)
    except Exception as error:  # noqa: BLE001 - without it a completion only starts no pause
        logger.warning("marsched: completions cannot be read for tool calls: %s: %s", type(error).__name__, error)
    setattr(state, STATE_KEY, reader)
    return reader


def _reader(serving: Any) -> ReadCalls | None:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    parser_cls = getattr(serving, "parser_cls", None)
    tool_cls = getattr(parser_cls, "tool_parser_cls", None)
    if tool_cls is None:
        return None
    from vllm.parser.engine.adapters import ParserEngineToolAdapter

    if issubclass(tool_cls, ParserEngineToolAdapter):
        return None
    parser = tool_cls(serving.renderer.tokenizer, None)
    request = ChatCompletionRequest(model="", messages=[])
    return lambda text: names_in(parser, text, request)


def names_in(parser: Any, text: str, request: Any) -> list[str]:
    """The names of the calls `parser` reads in `text`; [] when it reads none, or fails."""
    try:
        found = parser.extract_tool_calls(text, request)
    except Exception:  # noqa: BLE001 - text the parser chokes on is text that calls nothing
        return []
    if not getattr(found, "tools_called", False):
        return []
    names = []
    for call in getattr(found, "tool_calls", None) or ():
        name = getattr(getattr(call, "function", None), "name", None)
        if isinstance(name, str) and name:
            names.append(name)
    return names

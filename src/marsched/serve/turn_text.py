"""What a length prediction reads from an OpenAI request body: the newest turn's text, the
context's size, and the model's previous reply in the conversation.

Pure functions over the parsed JSON body; nothing here tokenizes (the caller turns characters
into tokens). A body this module cannot read gives None, and the request goes on unpredicted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

TAIL_CHARS = 4000  # the newest text of a prompt with no turn structure; the encoder reads no more


@dataclass(frozen=True, slots=True)
class TurnText:
    newest: str  # what this turn adds: the user's words or the tools' results
    context_chars: int  # the whole prompt
    previous_reply_chars: int | None  # the model's previous reply, when the body shows it


def chat_turn(messages: Any) -> TurnText | None:
    """A chat request: the newest turn is every message after the last assistant message (the
    tools' results and the user's words that follow the model's reply); the previous reply is
    that assistant message, its text and its tool calls."""
    if not isinstance(messages, list) or not messages:
        return None
    texts = [message_text(m) for m in messages]
    last_reply = max((i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "assistant"),
                     default=None)
    if last_reply is None:
        newest = texts[-1]
        previous = None
    else:
        newest = "\n".join(t for t in texts[last_reply + 1:] if t)
        previous = len(texts[last_reply])
    return TurnText(newest, sum(len(t) for t in texts), previous)


def completion_turn(prompt: Any, previous_context_chars: int | None,
                    previous_reply_chars: int | None) -> TurnText | None:
    """A completions request: the prompt is the whole conversation so far. With the conversation's
    previous prompt and reply known, the newest turn is what comes after them; without, the
    prompt's tail."""
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str):
        return None  # token ids or a batch of prompts: no text to read
    start = len(prompt) - TAIL_CHARS
    if previous_context_chars is not None and previous_reply_chars is not None:
        seen = previous_context_chars + previous_reply_chars
        if seen < len(prompt):
            start = seen
    return TurnText(prompt[max(start, 0):], len(prompt), previous_reply_chars)


def message_text(message: Any) -> str:
    """A chat message's text: its content (a string or text parts) and its tool calls' names and arguments."""
    if not isinstance(message, dict):
        return ""
    content = message.get("content")
    parts: list[str] = []
    if isinstance(content, str):
        parts.append(content)
    elif isinstance(content, list):
        parts.extend(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    for call in message.get("tool_calls") or ():
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict):
            parts.extend(str(function.get(k) or "") for k in ("name", "arguments"))
    return "\n".join(p for p in parts if p)

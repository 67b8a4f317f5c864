"""A request's history as the API server reads it, hashed as vLLM hashes KV blocks: how
data-parallel affinity (`affinity.py`) finds the rank of a conversation that names no id.

The engine core recognises such a follow-up by vLLM's block hashes (`marsched.vllm.follow_ups`),
but the rank must be chosen before vLLM tokenises the prompt, which it does in its serving code
after every middleware has run. Rendering the chat template and tokenising here as well would
cost milliseconds for an agent's 8,000-token prompt. So the front end hashes what a client sends
again unchanged in each follow-up:

- chat completions (`/v1/chat/completions`): each message;
- Messages (`/v1/messages`): `system`, then each message;
- completions (`/v1/completions`): the prompt in blocks of CHARS_PER_BLOCK characters, or of
  TOKENS_PER_BLOCK token ids when it is a list of them.

A message is hashed as canonical JSON (sorted keys) without `cache_control`: Anthropic clients
move that cache breakpoint to the newest message at every turn. Each unit's hash chains over all
the units before it, so equal hashes mean equal prefixes, and `FollowUps` (the engine's own class)
applies the same rule: a request continues a remembered turn when its units cover that turn's
prompt, up to its last full unit, the tail past it compared piece by piece, and go on past it.
Conversations that share a system prompt differ from their first user message on, so they are
never matched. A chat request with no message other than `system` or `developer` has no history
here: a conversation made of its system prompt alone is not one to continue.

`/v1/responses` is not read: vLLM 0.32 places those requests without reading the rank header
(`OpenAIServingResponses` passes no `data_parallel_rank`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from marsched.serve.asgi_body import MESSAGES_PATH
from marsched.vllm.follow_ups import prompt_tail

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
PATHS = (COMPLETIONS_PATH, CHAT_PATH, MESSAGES_PATH)  # those whose rank header vLLM reads
CHARS_PER_BLOCK = 256
TOKENS_PER_BLOCK = 64
SYSTEM_ROLES = ("system", "developer")
UNSTABLE = "cache_control"  # a field a client moves between turns: not part of the history


@dataclass(frozen=True, slots=True)
class History:
    """A request's prompt as hashed units, in the terms `FollowUps` takes."""

    hashes: list[bytes]  # one per full unit, each chained over all before it
    size: int  # the prompt's length: units, or characters or token ids of a completion's prompt
    tail: Sequence[Any] = ()  # a completion's prompt past its last full block
    prompt: Sequence[Any] | None = None  # what a remembered turn's tail is compared with


def chain(units: Sequence[bytes]) -> list[bytes]:
    hashes, parent = [], b""
    for unit in units:
        parent = hashlib.blake2b(unit, key=parent, digest_size=16).digest()
        hashes.append(parent)
    return hashes


def history_of(path: str, body: Any) -> History | None:
    """The history of a parsed request body to `path`; None when there is none to key on (a path
    not read here, a malformed body for vLLM to answer, a prompt shorter than one unit)."""
    if not isinstance(body, dict):
        return None
    if path == COMPLETIONS_PATH:
        return _prompt_history(body.get("prompt"))
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return None
    if path == CHAT_PATH:
        if all(isinstance(m, dict) and m.get("role") in SYSTEM_ROLES for m in messages):
            return None
        units = [_canonical(m) for m in messages]
    elif path == MESSAGES_PATH:
        units = [_canonical(body.get("system"))] + [_canonical(m) for m in messages]
    else:
        return None
    return History(chain(units), len(units))


def _prompt_history(prompt: Any) -> History | None:
    if isinstance(prompt, str):
        block, text = CHARS_PER_BLOCK, prompt
        units = [text[start:start + block].encode("utf-8", "surrogatepass")
                 for start in range(0, len(text) - block + 1, block)]
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        block, text = TOKENS_PER_BLOCK, prompt
        units = [",".join(map(str, text[start:start + block])).encode()
                 for start in range(0, len(text) - block + 1, block)]
    else:  # several prompts: vLLM makes one request of each
        return None
    if not units:
        return None
    return History(chain(units), len(text), prompt_tail(text, len(text), len(units), block), text)


def _canonical(value: Any) -> bytes:
    return json.dumps(_stable(value), sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode(
        "utf-8", "surrogatepass")


def _stable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _stable(v) for k, v in value.items() if k != UNSTABLE}
    if isinstance(value, list):
        return [_stable(v) for v in value]
    return value

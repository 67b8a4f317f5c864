"""Which tools a conversation's turn called: told by the API server, remembered by the scheduler.

The scheduler cannot read text; the API server can. When a chat completion of a conversation
ends with tool calls, the API server (`marsched.serve.tool_gaps`) sends the tools' names to the
engine core on vLLM's abort path, as `send_release` does (`retention.py`), in one id:

    marsched-tool:<conversation>\\x1f<name>[,<name>...]

The conversation id is the one the metadata allows (1 to 256 characters, no `/`; it may hold
anything else, so the names come after the last `\\x1f`); names are `metadata.tool_name`s (no
`\\x1f`, no `,`), at most MAX_HINT_TOOLS distinct ones. `MarsScheduler.finish_requests` takes
them (`conversation_steps.py`); a malformed one is dropped there.

A turn that names no conversation (its identity is inferred in the engine core, `follow_ups.py`)
is told by the request id the front end gave it (`vllm_xargs.marsched.rid`), which is all the
API server knows of it:

    marsched-called:<rid>\x1f<name>[,<name>...]

Its reply called tools: the turn pauses for them, and its KV is kept (`conversation_steps.py`).

`ConversationTools` is what the scheduler remembers per conversation: the tools its finished
turn called (pending until the follow-up arrives, which attributes the gap to them) and the
tools of its previous gap (the default guess for a turn whose hint has not arrived yet).

This module does not import vllm.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from marsched.vllm.metadata import MAX_CONVERSATION_CHARS, MAX_RID_CHARS, tool_name

TOOL_PREFIX = "marsched-tool:"
CALLED_PREFIX = "marsched-called:"  # a request, by its rid, whose reply called tools
SEPARATOR = "\x1f"  # ASCII unit separator: between the conversation and the names
NAMES_SEPARATOR = ","
MAX_HINT_TOOLS = 8  # distinct tools one hint names; a reply calling more is told its first 8
REMEMBERED = 100_000  # conversations whose tools are remembered; the least recently used go first


def tool_names(names: Any) -> tuple[str, ...]:
    """The distinct, sanitised names among `names` (strings; others dropped), in order, at most MAX_HINT_TOOLS."""
    seen = dict.fromkeys(tool_name(n) for n in names if isinstance(n, str) and n)
    return tuple(name for name in seen if name)[:MAX_HINT_TOOLS]


def hint_id(conversation: str, names: Any) -> str | None:
    """The abort-path id telling that `conversation`'s last turn called `names`; None if there
    is nothing to tell or the conversation id is not one the metadata allows."""
    tools = tool_names(names)
    if not tools or not 1 <= len(conversation) <= MAX_CONVERSATION_CHARS or "/" in conversation:
        return None
    return f"{TOOL_PREFIX}{conversation}{SEPARATOR}{NAMES_SEPARATOR.join(tools)}"


def read_hint(text: str) -> tuple[str, tuple[str, ...]] | None:
    """(conversation, tools) from what follows TOOL_PREFIX in a hint's id; None if malformed."""
    conversation, separator, names = text.rpartition(SEPARATOR)
    if not separator or not 1 <= len(conversation) <= MAX_CONVERSATION_CHARS or "/" in conversation:
        return None
    tools = tool_names(names.split(NAMES_SEPARATOR))
    return (conversation, tools) if tools else None


def called_id(rid: str, names: Any) -> str | None:
    """The abort-path id telling that request `rid`'s reply called `names`; None if there is nothing
    to tell or `rid` is not one the metadata allows."""
    tools = tool_names(names)
    if not tools or not 1 <= len(rid) <= MAX_RID_CHARS:
        return None
    return f"{CALLED_PREFIX}{rid}{SEPARATOR}{NAMES_SEPARATOR.join(tools)}"


def read_called(text: str) -> tuple[str, tuple[str, ...]] | None:
    """(rid, tools) from what follows CALLED_PREFIX; None if malformed."""
    rid, separator, names = text.rpartition(SEPARATOR)
    if not separator or not 1 <= len(rid) <= MAX_RID_CHARS:
        return None
    tools = tool_names(names.split(NAMES_SEPARATOR))
    return (rid, tools) if tools else None


async def send_called(engine_client: Any, rid: str, names: Any) -> bool:
    """From the API server: tell the engine core that request `rid`'s reply called `names` (every
    data-parallel rank; the one that ran it acts). False if there was nothing to send."""
    from marsched.vllm.abort_routing import send_to_every_rank

    hint = called_id(rid, names)
    if hint is None:
        return False
    await send_to_every_rank(engine_client.engine_core, [hint])
    return True


async def send_tool_hint(engine_client: Any, conversation: str, names: Any) -> bool:
    """From the API server: tell the engine core that `conversation`'s last turn called `names`.
    Sent to every data-parallel rank, as a release is (`retention.send_release`): only the rank
    that ran the turn knows the conversation; the others drop it. False if there was nothing to send."""
    from marsched.vllm.abort_routing import send_to_every_rank

    hint = hint_id(conversation, names)
    if hint is None:
        return False
    await send_to_every_rank(engine_client.engine_core, [hint])
    return True


@dataclass(slots=True)
class _Tools:
    awaiting: bool = False  # a turn ended; its follow-up has not arrived
    pending: tuple[str, ...] = ()  # the tools the ended turn called (its hint)
    last: tuple[str, ...] = ()  # the tools the conversation's last observed gap was attributed to


class ConversationTools:
    """Per conversation, the tools of its gaps, in the scheduler."""

    def __init__(self, remembered: int = REMEMBERED) -> None:
        self.remembered = remembered
        self._of: OrderedDict[str, _Tools] = OrderedDict()

    def ended(self, conversation: str) -> tuple[str, ...]:
        """A turn of `conversation` ended: its hint is awaited. Returns the tools to expect until
        it comes: those of the conversation's previous gap (agents call the same tool again and
        again), or () when there are none."""
        tools = self._get(conversation)
        tools.awaiting, tools.pending = True, ()
        return tools.last

    def hinted(self, conversation: str, names: tuple[str, ...]) -> bool:
        """The API server says the ended turn called `names`. Taken only while its follow-up is
        awaited: a conversation this scheduler never ran (another data-parallel rank's) has
        nothing to learn, and a hint later than the follow-up would be attributed to the gap
        after it. Returns whether it was taken."""
        tools = self._of.get(conversation)
        if tools is None or not tools.awaiting:
            return False
        tools.pending = names
        self._of.move_to_end(conversation)
        return True

    def arrived(self, conversation: str, stated: str | None) -> tuple[str, ...]:
        """The follow-up arrived: the tools its gap is attributed to. The hint's, else the
        `tool` the follow-up says it carries the result of, else () (the global estimate only)."""
        tools = self._get(conversation)
        named = tools.pending or ((stated,) if stated else ())
        tools.awaiting, tools.pending = False, ()
        if named:
            tools.last = named
        return named

    def __len__(self) -> int:
        return len(self._of)

    def _get(self, conversation: str) -> _Tools:
        tools = self._of.pop(conversation, None) or _Tools()
        self._of[conversation] = tools
        while len(self._of) > self.remembered:
            self._of.popitem(last=False)
        return tools

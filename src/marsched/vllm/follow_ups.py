"""A conversation's identity without our fields: a request that continues a recently finished turn.

A client that names no conversation (no `vllm_xargs.marsched.conversation`, no alias the front
end reads: `marsched.serve.program_fields`) still sends each follow-up with the whole history:
its prompt starts with the previous turn's prompt and reply. vLLM's prefix cache hashes exactly
that, block by block, each hash chained over all the blocks before it (`Request.block_hashes`,
computed in the engine core from the token ids whatever we do). So equal hashes at block k mean
equal token prefixes through block k, and a single dict lookup compares whole prefixes.

When a turn of an inferred conversation finishes (`finished`), two of its hashes are remembered,
each mapping to its conversation:

- the reply's end: the last full block of prompt + reply (the follow-up re-sends the reply as
  the model wrote it);
- the prompt's end: the last full block of the prompt, for a chat template that renders the
  reply back in other tokens than the model's (tool-call JSON respaced, say).

A new request looks its own hashes up from its longest prefix down and stops at the first one
remembered (`match`): a follow-up finds its previous turn after the few blocks of its tool result.
Either matches only a request longer than the turn's prompt: the same prompt sent again (a retry,
or another conversation replaying the same history) continues nothing. A hash that ends short of
the prompt's end (the prompt's own end, or a reply that filled no block) leaves the prompt's last
tokens, its tail (fewer than a block), unhashed: there the request's tokens at those positions are
compared with the tail, at most a block of them. Without it, a short first message after a shared
system prompt, all of it in the tail, matched any longer request with that system prompt. A hash remembered
by several conversations (the same whole history, through that block) is ambiguous and matches none: two conversations are never merged unless nothing in their tokens
tells them apart. Conversations that share a system prompt differ from their first user
message on, so neither end of one is ever a prefix of the other's follow-up.

The cost is one dict lookup per block that the follow-up adds (its tool result), and one per
prompt block for a request that continues nothing; inserting and expiring are O(1). Entries
expire `window_s` after their turn ended (the caller ends the program then), and the
`limit` least recent go first.

`PendingTurn`: a finished inferred turn waiting for the API server to say that its reply
called a tool (`marsched.vllm.tool_hints`, a `marsched-called:` hint): only then is its KV kept
(`ConversationSteps._reply_called`). Its blocks went back to vLLM's prefix cache at the finish,
still hashed; `still_cached` takes those not evicted since.

This module does not import vllm.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

INFERRED_PREFIX = "auto-"  # the id of an inferred conversation: this and its first turn's request id
WINDOW_S = 900.0  # a turn continued later than this starts a new conversation
REMEMBERED = 100_000  # finished turns remembered; the least recent go first
PENDING_S = 60.0  # how long a finished turn waits for the API server's word on its reply
PENDING_KEPT = 10_000


@dataclass(frozen=True, slots=True)
class TurnKey:
    """A hash a finished turn is remembered by, and what a request holding it must also show."""

    hash: bytes
    shorter: int  # the turn's prompt tokens: a follow-up has more
    tail: Sequence[Any] = ()  # the prompt's tokens past this hash, which the follow-up holds at the same positions

    def continued_by(self, size: int, tokens: Sequence[Any] | None) -> bool:
        if size <= self.shorter:
            return False
        if not self.tail:
            return True
        return tokens is not None and tokens[self.shorter - len(self.tail):self.shorter] == self.tail


@dataclass(slots=True)
class FinishedTurn:
    conversation: str
    end_t: float
    keys: tuple[TurnKey, ...]  # the hashes it is remembered by


@dataclass(slots=True)
class PendingTurn:
    """A finished inferred turn whose KV may yet be kept, if its reply called a tool."""

    conversation: str
    rid: str  # the caller's id (the API server's word names it)
    request_id: str  # vLLM's internal id of the finished turn
    tokens: list[int]  # its token ids, prompt and reply
    context_tokens: int  # computed at its end
    blocks: list[Any]  # its device blocks, in order, freed to the prefix cache at its end
    hashes: list[Any]  # each block's hash at the end (a block evicted since has another, or none)
    end_t: float


def still_cached(blocks: Sequence[Any], hashes: Sequence[Any]) -> list[Any]:
    """The leading blocks that still hold what they held at the turn's end (a block evicted
    and reused since has another hash, or none); the first that does not ends the prefix."""
    kept = []
    for block, hashed in zip(blocks, hashes):
        if hashed is None or getattr(block, "block_hash", None) != hashed:
            break
        kept.append(block)
    return kept


def turn_keys(prompt_tokens: int, prompt_blocks: int, hashes: Sequence[bytes],
              tail: Sequence[Any] = ()) -> tuple[TurnKey, ...]:
    """The hashes a finished turn is remembered by: its reply's end and its prompt's end; one when
    the reply filled no block, none when not a block is full. `tail`: the prompt's tokens past its
    last full block, which a key short of the prompt's end checks (`TurnKey.continued_by`)."""
    keys = []
    if hashes:
        keys.append(TurnKey(hashes[-1], prompt_tokens, tail if len(hashes) <= prompt_blocks else ()))
    if 0 < prompt_blocks < len(hashes):
        keys.append(TurnKey(hashes[prompt_blocks - 1], prompt_tokens, tail))
    return tuple(keys)


def prompt_tail(tokens: Sequence[Any], prompt_tokens: int, prompt_blocks: int, block_size: int) -> Sequence[Any]:
    """The prompt's tokens past its last full block (fewer than `block_size`)."""
    return tokens[prompt_blocks * block_size:prompt_tokens]


@dataclass
class FollowUps:
    """The finished turns of inferred conversations, by the hashes a follow-up's prompt holds."""

    window_s: float = WINDOW_S
    limit: int = REMEMBERED
    _owners: dict[bytes, list[tuple[str, TurnKey]]] = field(default_factory=dict)  # hash -> (conversation, its key)
    _turns: OrderedDict[str, FinishedTurn] = field(default_factory=OrderedDict)  # by end time
    pending: OrderedDict[str, PendingTurn] = field(default_factory=OrderedDict)  # conversation -> its turn
    _pending_of: dict[str, str] = field(default_factory=dict)  # the caller's rid -> its conversation
    matched: int = 0  # requests found to continue a conversation
    ambiguous: int = 0  # requests whose longest remembered prefix several conversations share

    def match(self, hashes: Sequence[bytes], prompt_tokens: int, tokens: Sequence[Any] | None = None) -> str | None:
        """The conversation whose finished turn the request with these block hashes (and this many
        prompt tokens, `tokens` themselves to check a turn's tail) continues, or None."""
        owners = self._owners
        for index in range(len(hashes) - 1, -1, -1):
            found = owners.get(hashes[index])
            if found is None:
                continue
            continues = [conversation for conversation, key in found if key.continued_by(prompt_tokens, tokens)]
            if len(continues) == 1:
                self.matched += 1
                return continues[0]
            if continues:
                self.ambiguous += 1
                return None
        return None

    def finished(self, conversation: str, prompt_tokens: int, prompt_blocks: int, hashes: Sequence[bytes],
                 end_t: float, tail: Sequence[Any] = ()) -> None:
        """A turn of `conversation` ended with these block hashes (prompt and reply; its prompt of
        `prompt_tokens` filled `prompt_blocks` of them, `tail` the rest, `prompt_tail`). It replaces
        the conversation's previous turn."""
        self._drop(conversation)
        turn = FinishedTurn(conversation, end_t, turn_keys(prompt_tokens, prompt_blocks, hashes, tail))
        for key in turn.keys:
            self._owners.setdefault(key.hash, []).append((conversation, key))
        self._turns[conversation] = turn
        while len(self._turns) > self.limit:
            self._drop(next(iter(self._turns)))

    def expire(self, now: float) -> list[str]:
        """Forget the turns that ended more than `window_s` ago; their conversations, oldest first."""
        ended = []
        turns = self._turns
        while turns:
            turn = next(iter(turns.values()))
            if turn.end_t + self.window_s > now:
                break
            self._drop(turn.conversation)
            ended.append(turn.conversation)
        pending = self.pending
        while pending:
            waiting = next(iter(pending.values()))
            if waiting.end_t + PENDING_S > now and len(pending) <= PENDING_KEPT:
                break
            self._pending_of.pop(pending.popitem(last=False)[1].rid, None)
        return ended

    def wait_for_reply(self, turn: PendingTurn) -> None:
        """`turn` ended; its KV is kept if the API server says its reply called a tool (`replied`)."""
        self.continued(turn.conversation)
        self.pending[turn.conversation] = turn
        self._pending_of[turn.rid] = turn.conversation

    def replied(self, rid: str) -> PendingTurn | None:
        """The API server's word on request `rid`'s reply: its turn, if it still waits for it."""
        conversation = self._pending_of.pop(rid, None)
        turn = self.pending.get(conversation) if conversation is not None else None
        if turn is None or turn.rid != rid:
            return None
        del self.pending[conversation]
        return turn

    def continued(self, conversation: str) -> None:
        """A follow-up of `conversation` arrived (or a later turn ended): a word on the reply comes too late."""
        turn = self.pending.pop(conversation, None)
        if turn is not None:
            self._pending_of.pop(turn.rid, None)

    def __len__(self) -> int:
        return len(self._turns)

    def __contains__(self, conversation: str) -> bool:
        return conversation in self._turns

    def snapshot(self) -> dict[str, int]:
        return {"follow_ups_matched": self.matched, "follow_ups_ambiguous": self.ambiguous,
                "follow_ups_remembered": len(self._turns), "follow_ups_pending": len(self.pending)}

    def _drop(self, conversation: str) -> None:
        turn = self._turns.pop(conversation, None)
        if turn is None:
            return
        for key in turn.keys:
            owners = self._owners.get(key.hash)
            if owners is not None and (conversation, key) in owners:
                owners.remove((conversation, key))
                if not owners:
                    del self._owners[key.hash]

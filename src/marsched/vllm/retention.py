"""Conversation KV retention inside vLLM: keep a finished turn's KV until its follow-up.

A request whose marsched metadata names a `conversation` is one turn of it. When the turn
finishes (its response carried a tool call, say), `ConversationKeeper.keep` applies the
strategy the retention rule chose (`marsched.policy.retention`):

- Preserve: the turn's cached full blocks get one more reference, so vLLM's prefix cache
  cannot evict them; the follow-up, whose prompt starts with the same tokens, finds them
  as an ordinary prefix-cache hit. The reference is dropped when the follow-up has been
  scheduled (its own references hold them then), or at the end of the retention.
- Swap: the full blocks are copied to host memory by the Swap connector (`kv_swap.py`,
  under the key `marsched-conv:<request id>`), pinned until the copy has run, then freed
  and taken out of the prefix cache: the context is on the host only. The follow-up's
  matching prefix is loaded back as the connector's external hit.
- Discard: nothing is kept; the blocks go back to vLLM's prefix cache as they would in
  stock vLLM (reusable until evicted).

Once the API server has told which tools the turn called (`tool_hints.py`), the scheduler may
decide again with those tools' gap estimate (`change`): a Preserve can become a Swap (the pinned
blocks are copied out as a kept Swap's are) or a Discard (released); a Swap can become a Discard.
A Swap does not become a Preserve: its copy is sent with the step after the turn ends, before
any hint can arrive, and from then on its device blocks are going. Nothing becomes a Preserve
or a Swap from a Discard: the blocks went back to vLLM's prefix cache, where nothing holds them.

A retention ends when the follow-up is scheduled (a hit), when the conversation is
released (`send_release`: vLLM's abort message to the engine core, carrying the id
`marsched-release:<conversation>`, which `MarsScheduler.finish_requests` takes), when vLLM cannot
allocate a request's blocks (the newest program's Preserve first, `policy/pins.py`, as the simulator
gives pins up; then the pins of follow-ups still waiting; `ConversationSteps._allocate_giving_way`),
or at its time limit. A follow-up of a
conversation whose KV was not kept (discarded, expired, released) is a miss.

Every private vLLM name used here is listed in docs/vllm-internals.md.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from marsched.policy import Strategy
from marsched.policy.pins import release_order

RELEASE_PREFIX = "marsched-release:"
HOST_KEY_PREFIX = "marsched-conv:"
_SEEN_KEPT = 100_000  # conversations remembered after their last turn, for hit/miss counting


@dataclass(eq=False)
class Kept:
    conversation: str
    rid: str  # the finished turn's internal request id
    strategy: Strategy
    tokens: list[int]  # the context whose KV is kept (whole blocks)
    kept_t: float
    expires_t: float
    program_arrival_t: float  # when its program's first turn arrived: pins give way newest program first
    pinned: list[Any] = field(default_factory=list)  # device blocks holding our extra reference
    host_key: str | None = None  # Swap: the connector's key of the host copy
    copy_step: Any = None  # Swap: the scheduler output whose metadata carries the copy
    copied: bool = False
    claimed_by: str | None = None  # the follow-up's internal id, once it has arrived
    reusable_tokens: int = 0  # of the follow-up's prompt, the kept prefix it will find (whole blocks)
    decided: Any = None  # what the scheduler decided from, to decide again (`conversation_steps.KeptDecision`)


@dataclass(slots=True)
class RetentionStats:
    hits: int = 0  # follow-ups that found their conversation's KV kept
    misses: int = 0  # follow-ups of a known conversation whose KV was not kept
    expired: int = 0
    released: int = 0  # by the front end, or for room
    reused_tokens: int = 0  # context tokens follow-ups did not recompute (prefix hit + host load)
    redecided: int = 0  # kept turns whose strategy changed once their tools were known
    yielded: int = 0  # waiting follow-ups whose pinned blocks went back to the prefix cache for another request


async def send_release(engine_client: Any, conversation: str) -> None:
    """From the API server: free what the engine keeps of `conversation`, before its next step.

    `AsyncLLM.abort` drops ids its front end does not know, so the release goes to the engine
    core's client directly (`engine_client.engine_core`). Under data parallelism that client
    too drops ids it did not place, so the release is sent to every rank's engine core
    (`_abort_requests`, one message each): only the rank that keeps the conversation has
    anything to free."""
    from marsched.vllm.abort_routing import send_to_every_rank

    await send_to_every_rank(engine_client.engine_core, [RELEASE_PREFIX + conversation])


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class ConversationKeeper:
    """The kept turns of one scheduler, by conversation."""

    def __init__(self, block_pool: Any, block_size: int, swapper: Any | None) -> None:
        self.pool = block_pool
        self.block_size = block_size
        self.swapper = swapper
        self.kept: dict[str, Kept] = {}  # conversation -> its kept turn
        self.claims: dict[str, Kept] = {}  # follow-up's internal id -> the turn it reuses
        self.landing: list[Kept] = []  # released while their copy was in flight
        self.last_end_t: OrderedDict[str, float] = OrderedDict()  # conversation -> its last turn's end
        self.stats = RetentionStats()
        self._timer: threading.Timer | None = None  # one timer, for the earliest time limit
        self._timer_t = math.inf

    # --- a turn ends ------------------------------------------------------------------

    def keep(self, conversation: str, rid: str, token_ids: list[int], computed_tokens: int,
             blocks: list[Any], strategy: Strategy, now: float, hold_s: float,
             program_arrival_t: float | None = None) -> Kept | None:
        """Keep a finishing turn's KV (`blocks`: its device blocks, in order, still allocated);
        `program_arrival_t`: its program's first arrival (None: unknown, taken as now)."""
        self.release(conversation, counted=False)
        self._remember(conversation, now)
        if strategy is Strategy.DISCARD or hold_s <= 0:
            return None
        full = min(computed_tokens // self.block_size, len(blocks))
        if strategy is Strategy.PRESERVE:
            # Only hashed blocks are found by the follow-up's prefix lookup.
            full = next((i for i, b in enumerate(blocks[:full]) if b.block_hash is None), full)
        if full == 0:
            return None
        if strategy is Strategy.SWAP and self.swapper is None:
            strategy = Strategy.PRESERVE
        kept = Kept(conversation, rid, strategy, list(token_ids[:full * self.block_size]), now, now + hold_s,
                    now if program_arrival_t is None else program_arrival_t)
        kept.pinned = list(blocks[:full])
        self.pool.touch(kept.pinned)
        if strategy is Strategy.SWAP:
            kept.host_key = HOST_KEY_PREFIX + rid
            self.swapper.queue_swap_out(kept.host_key, [b.block_id for b in kept.pinned], len(kept.tokens))
        self.kept[conversation] = kept
        return kept

    def ended(self, conversation: str, now: float) -> None:
        """A turn of `conversation` ended with nothing kept (yet): its follow-up is a miss unless
        `keep` follows."""
        self._remember(conversation, now)

    def change(self, conversation: str, strategy: Strategy) -> Strategy | None:
        """Decide a kept turn again (the module's docstring says what can change). Returns the
        strategy in force now, or None if nothing of `conversation` is kept."""
        kept = self.kept.get(conversation)
        if kept is None:
            return None
        if strategy is kept.strategy or (kept.strategy is Strategy.SWAP and strategy is not Strategy.DISCARD):
            return kept.strategy
        if strategy is Strategy.SWAP and self.swapper is None:
            return kept.strategy
        self.stats.redecided += 1
        if strategy is Strategy.DISCARD:
            self.release(conversation, counted=False)
            return Strategy.DISCARD
        # Preserve -> Swap: the pinned blocks are copied out as `keep` copies a Swap's.
        kept.strategy = Strategy.SWAP
        kept.host_key = HOST_KEY_PREFIX + kept.rid
        self.swapper.queue_swap_out(kept.host_key, [b.block_id for b in kept.pinned], len(kept.tokens))
        return Strategy.SWAP

    def copy_sent(self, host_key: str, step: Any) -> None:
        for kept in self.kept.values():
            if kept.host_key == host_key and kept.copy_step is None:
                kept.copy_step = step
                return

    def copies_done(self, step: Any) -> bool:
        """The step that carried some copies to the worker has run: their device blocks go.
        Returns whether any copy landed."""
        landed = [k for k in self.landing if k.copy_step is step]
        self.landing = [k for k in self.landing if k.copy_step is not step]
        for kept in landed:
            kept.copied = True
            self._unpin(kept)
            self._drop_host(kept)
        done = len(landed)
        for kept in list(self.kept.values()) + list(self.claims.values()):
            if kept.copy_step is step and not kept.copied:
                done += 1
                kept.copied = True
                if kept.claimed_by is not None:  # the follow-up came first: it reads the device copy
                    self._drop_host(kept)
                    continue
                blocks = kept.pinned
                self._unpin(kept)
                # On the host only: a later prefix lookup must not find the freed blocks.
                self.pool.evict_blocks({b.block_id for b in blocks if b.ref_cnt == 0})
        return done > 0

    # --- the follow-up ----------------------------------------------------------------

    def claim(self, conversation: str, rid: str, prompt_token_ids: list[int], now: float) -> float | None:
        """A request of `conversation` arrives: count a hit or a miss, set up a host load.
        Returns the gap since the conversation's last turn ended (None: a new conversation)."""
        end_t = self.last_end_t.get(conversation)
        gap = None if end_t is None else now - end_t
        kept = self.kept.pop(conversation, None)
        if kept is None:
            if gap is not None:
                self.stats.misses += 1
            return gap
        self.stats.hits += 1
        kept.claimed_by = rid
        self.claims[rid] = kept
        usable = (len(prompt_token_ids) - 1) // self.block_size * self.block_size  # one token is computed
        matched = min(common_prefix(kept.tokens, prompt_token_ids), usable)
        kept.reusable_tokens = matched - matched % self.block_size
        if kept.host_key is not None:
            if not kept.copied and self.swapper.cancel_swap_out(kept.host_key):
                kept.host_key = None  # not copied yet: the pinned device blocks serve it
            elif kept.copied and kept.reusable_tokens > 0:
                self.swapper.expect_load[rid] = kept.reusable_tokens
                self.swapper.load_from[rid] = kept.host_key
        return gap

    def reusable(self, rid: str) -> int:
        """Of a waiting follow-up's prompt, the tokens its kept turn will give it (0: none kept,
        or given up for the queue's head): KV the engine holds for it, on the device or the host,
        as the simulator counts a resumed request's."""
        kept = self.claims.get(rid)
        if kept is None or not (kept.pinned or (kept.host_key is not None and kept.copied)):
            return 0
        return kept.reusable_tokens

    def scheduled(self, rid: str, reused_tokens: int) -> None:
        """The follow-up got its blocks: our references and any host copy left can go."""
        kept = self.claims.pop(rid, None)
        if kept is None:
            return
        self.stats.reused_tokens += max(reused_tokens, 0)
        self._unpin(kept)
        self._drop_host(kept)

    def forget(self, rid: str) -> None:
        """A request ended: if it was a follow-up never scheduled, its claim ends too."""
        kept = self.claims.pop(rid, None)
        if kept is not None:
            if self.swapper is not None:
                self.swapper.drop(rid)
            self._unpin(kept)
            self._drop_host(kept)

    # --- ends -------------------------------------------------------------------------

    def release(self, conversation: str, counted: bool = True) -> bool:
        kept = self.kept.pop(conversation, None)
        if kept is None:
            return False
        if counted:
            self.stats.released += 1
        if kept.host_key is not None and not kept.copied and self.swapper.cancel_swap_out(kept.host_key):
            kept.host_key = None
        if kept.copy_step is not None and not kept.copied:
            self.landing.append(kept)  # the copy is on its way (async scheduling): drop it when it lands
            return True
        self._unpin(kept)
        self._drop_host(kept)
        return True

    def expire(self, now: float) -> int:
        """End the retentions past their time limit; how many."""
        ended = 0
        for conversation, kept in list(self.kept.items()):
            if kept.expires_t <= now:
                self.release(conversation, counted=False)
                self.stats.expired += 1
                ended += 1
        return ended

    def relieve(self, free_blocks: int, needed_blocks: int, head_rid: str | None = None) -> int:
        """Make `needed_blocks` free for request `head_rid`, whose allocation failed: release Preserve
        retentions, the newest program's first (`policy/pins.py`), then unpin the blocks of other
        follow-ups still waiting, the longest kept first; returns how many of both.

        A follow-up that arrived keeps its turn's blocks pinned until it is scheduled. If it waits
        behind a request that does not fit, nothing else may ever free them (an engine with nothing
        running waits for ever), so its blocks go back to vLLM's prefix cache: it still finds
        them there unless the other's allocation evicts them, and then recomputes them."""
        released = 0
        pins = [k for k in self.kept.values() if k.strategy is Strategy.PRESERVE and k.claimed_by is None]
        for kept in release_order(pins, lambda k: (k.program_arrival_t, k.conversation)):
            if free_blocks >= needed_blocks:
                return released
            conversation = kept.conversation
            freed = sum(1 for b in kept.pinned if b.ref_cnt == 1)
            self.release(conversation)
            free_blocks += freed
            released += 1
        for rid, kept in sorted(self.claims.items(), key=lambda item: item[1].kept_t):
            if free_blocks >= needed_blocks:
                break
            if rid == head_rid or not kept.pinned:
                continue
            free_blocks += sum(1 for b in kept.pinned if b.ref_cnt == 1)
            self._unpin(kept)
            self.stats.yielded += 1
            released += 1
        return released

    def due(self, now: float) -> bool:
        """Whether the engine must step to end a retention past its time (a copy to send keeps it
        stepping through the connector's `has_pending_push_work`)."""
        # The timer's time passing counts too: what it was set for may have ended otherwise, and
        # the step that follows sets it for the next limit.
        return (any(k.expires_t <= now for k in self.kept.values()) or bool(self.landing)
                or now >= self._timer_t)

    def arm(self, now: float, wake: Any) -> None:
        """Have `wake` called at the earliest time limit of what is kept (an idle engine sleeps on
        its input queue, and only a step ends a retention). One timer thread at a time."""
        due_t = min((k.expires_t for k in self.kept.values()), default=math.inf)
        if due_t == self._timer_t and (self._timer is None or self._timer.is_alive()):
            return
        self.close()
        if due_t < math.inf:
            self._timer = threading.Timer(max(due_t - now, 0.0), wake)
            self._timer.daemon = True
            self._timer.start()
            self._timer_t = due_t

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._timer_t = None, math.inf

    # --- state ------------------------------------------------------------------------

    def snapshot(self) -> dict[str, int]:
        by = {s: 0 for s in (Strategy.PRESERVE, Strategy.SWAP)}
        for kept in self.kept.values():
            by[kept.strategy] = by.get(kept.strategy, 0) + 1
        return {
            "retained_preserve": by[Strategy.PRESERVE],
            "retained_swap": by[Strategy.SWAP],
            "retained_device_blocks": sum(len(k.pinned) for k in self.kept.values()),
            "retained_host_tokens": sum(len(k.tokens) for k in self.kept.values()
                                        if k.host_key is not None and k.copied),
            "retention_hits": self.stats.hits,
            "retention_misses": self.stats.misses,
            "retention_expired": self.stats.expired,
            "retention_released": self.stats.released,
            "retention_reused_tokens": self.stats.reused_tokens,
            "retention_redecided": self.stats.redecided,
            "retention_yielded": self.stats.yielded,
        }

    # --- helpers ----------------------------------------------------------------------

    def _remember(self, conversation: str, now: float) -> None:
        self.last_end_t[conversation] = now
        self.last_end_t.move_to_end(conversation)
        while len(self.last_end_t) > _SEEN_KEPT:
            self.last_end_t.popitem(last=False)

    def _unpin(self, kept: Kept) -> None:
        blocks, kept.pinned = kept.pinned, []
        if blocks:
            # Tail block first, as vLLM's `KVCacheManager.free` frees a request's: the free queue hands
            # out its head first, so a partly reused kept turn still leaves a prefix for its follow-up.
            # Head first, the first block handed out would take the whole prefix with it.
            self.pool.free_blocks(list(reversed(blocks)))

    def _drop_host(self, kept: Kept) -> None:
        if kept.host_key is not None and self.swapper is not None:
            self.swapper.drop(kept.host_key)

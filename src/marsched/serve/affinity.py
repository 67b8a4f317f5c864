"""Data-parallel affinity: every turn of a conversation runs on the rank that holds its KV.

vLLM's data-parallel balancer places each request anew, so a conversation's follow-up lands
on whichever rank is least loaded at that moment, and the KV its previous turn kept on the
other rank is of no use. This ASGI middleware (`--middleware
marsched.serve.affinity.DataParallelAffinityMiddleware`, added by `marsched serve`) reads
the conversation id (`vllm_xargs.marsched.conversation`) of each `POST /v1/completions` and
`/v1/chat/completions` and sets vLLM's own routing header, `X-data-parallel-rank`
(`_get_data_parallel_rank` in vLLM's serving code), to the conversation's rank:

- the rank of its earlier turns, when it has had one here;
- else the rank the client named in that header (it is kept for the later turns);
- else the rank the placement rule chooses (`marsched.policy.placement`; `MARSCHED_DP_PLACEMENT`, default
  `least-loaded`), from each rank's scheduler state, read at most every `LOOK_EVERY_S`.

A turn with `retain: false` is the conversation's last: its rank is forgotten after it, as it
is on `DELETE /marsched/conversations/ID` (`state.py`). Nothing is done with one rank.

A request that names no conversation may still be a turn of one, recognised from its history
(`history.py`) by the rule the engine core uses (`marsched.vllm.follow_ups.FollowUps`): its
messages (or its completion prompt) continue a turn that ended here, whose rank it gets; else it
starts a conversation, placed as a new one is. When its reply ends (HTTP 200), its history is
remembered for its follow-up, in place of its previous turn's, until `follow_ups.WINDOW_S` has
passed, the window after which the engine core ends it too. The same applies to
`/v1/messages` (vLLM serves it through its chat code, which reads the rank header); vLLM 0.32
does not read the header on `/v1/responses`, so neither does this middleware. Bodies that are not
JSON or whose marsched field is malformed (vLLM's validator answers those with a 400), and
requests with no history to key on, pass through as they came, to vLLM's balancer.

With several API server processes (`--api-server-count`; `marsched serve` starts one under
data parallelism unless given) the processes share no state, so each conversation's rank is a
hash of its id (`Placement.HASH`): every process computes the same one. An inferred
conversation's follow-up finds its rank only in the process that served its previous turn.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from marsched.serve.asgi_body import COMPLETION_PATHS, MESSAGES_PATH, read_body, replay_body
from marsched.serve.history import History, history_of
from marsched.vllm.follow_ups import FollowUps
from marsched.policy.placement import (Placement, RankLoad, hashed_rank, least_loaded_scores, lowest,
                                      mars_scores)

ENV = "MARSCHED_DP_PLACEMENT"
PATHS = COMPLETION_PATHS + (MESSAGES_PATH,)  # the endpoints whose rank header vLLM 0.32 reads
INFERRED = "inferred/"  # an inferred conversation's id here: a `/` no named one may hold
HEADER = b"x-data-parallel-rank"
LOOK_EVERY_S = 0.5  # the schedulers recompute their memory × time this often
LOOK_TIMEOUT_S = 2.0
REMEMBERED = 100_000  # conversations whose rank is kept; the oldest is forgotten first
STATE_KEY = "marsched_affinity"  # the router's attribute on vLLM's app.state

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Turn:
    conversation: str
    last: bool  # retain: false


def turn_of(raw: bytes) -> Turn | None:
    """The conversation this body is a turn of, or None (none named, or not a body we read)."""
    return named_turn(parsed(raw))


def parsed(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None


def named_turn(body: Any) -> Turn | None:
    """The conversation a parsed body names, or None."""
    from marsched.vllm.metadata import KEY, MetadataError, parse

    xargs = body.get("vllm_xargs") if isinstance(body, dict) else None
    if not isinstance(xargs, dict):
        return None
    try:
        meta = parse(xargs.get(KEY))
    except MetadataError:
        return None
    if meta is None or meta.conversation is None:
        return None
    return Turn(meta.conversation, not meta.retain)


class ConversationRouter:
    """The ranks of this front end's conversations, and the load it places new ones by."""

    def __init__(self, ranks: int, placement: Placement, look: Any = None) -> None:
        self.ranks = ranks
        self.placement = placement
        self._look = look  # async () -> list[RankLoad], one per rank
        self.rank_of: OrderedDict[str, int] = OrderedDict()
        self.loads = [RankLoad() for _ in range(ranks)]
        self.placed_since = [0] * ranks  # new conversations placed since the last look
        self.in_flight = [0] * ranks  # turns this front end routed that have not answered yet
        self.placed = [0] * ranks  # new conversations placed, ever
        self._start = 0
        self._looked_t = -float("inf")
        self._looking: asyncio.Task | None = None
        self.follow = FollowUps(limit=REMEMBERED)  # the turns of conversations that name no id, by their history
        self._inferred = 0  # inferred conversations started here

    def inferred(self, history: History) -> str:
        """The conversation a request naming none continues (its history's), or a new one's id."""
        for ended in self.follow.expire(time.monotonic()):
            self.forget(ended)
        conversation = self.follow.match(history.hashes, history.size, history.prompt)
        if conversation is None:
            self._inferred += 1
            conversation = f"{INFERRED}{self._inferred}"
        return conversation

    def turn_ended(self, conversation: str, history: History, answered: bool) -> None:
        """An inferred conversation's turn ended: answered, its follow-up will continue this history;
        else a conversation with no answered turn is forgotten (no follow-up can find it)."""
        if answered:
            self.follow.finished(conversation, history.size, len(history.hashes), history.hashes, time.monotonic(),
                                 history.tail)
        elif conversation not in self.follow:
            self.forget(conversation)

    async def rank_for(self, turn: Turn, given: int | None) -> int:
        rank = self.rank_of.get(turn.conversation)
        if rank is None:
            rank = given if given is not None and 0 <= given < self.ranks else await self._place(turn.conversation)
        self.rank_of[turn.conversation] = rank
        self.rank_of.move_to_end(turn.conversation)
        while len(self.rank_of) > REMEMBERED:
            self.rank_of.popitem(last=False)
        return rank

    def forget(self, conversation: str) -> None:
        self.rank_of.pop(conversation, None)

    def state(self) -> dict[str, Any]:
        return {"placement": self.placement.value, "conversations": len(self.rank_of),
                "conversations_by_rank": [sum(r == rank for r in self.rank_of.values()) for rank in range(self.ranks)],
                "placed_by_rank": list(self.placed), "in_flight_by_rank": list(self.in_flight),
                "inferred_started": self._inferred, "inferred_matched": self.follow.matched,
                "inferred_ambiguous": self.follow.ambiguous, "inferred_remembered": len(self.follow)}

    async def _place(self, conversation: str) -> int:
        if self.placement is Placement.HASH:
            rank = hashed_rank(conversation, self.ranks)
        else:
            await self._refresh()
            scores = (mars_scores(self.loads, self.placed_since) if self.placement is Placement.MARS
                      else least_loaded_scores(self.loads, self.placed_since, self.in_flight))
            rank = lowest(scores, self._start)
            self._start = (self._start + 1) % self.ranks
        self.placed_since[rank] += 1
        self.placed[rank] += 1
        return rank

    async def _refresh(self) -> None:
        if self._look is None or time.monotonic() - self._looked_t < LOOK_EVERY_S:
            return
        if self._looking is None or self._looking.done():
            self._looking = asyncio.create_task(self._look_now())
        await asyncio.shield(self._looking)

    async def _look_now(self) -> None:
        try:
            loads = await self._look()
        except Exception:  # noqa: BLE001 - a busy engine leaves the last look in place
            loads = None
        self._looked_t = time.monotonic()
        if loads is not None and len(loads) == self.ranks:
            self.loads = list(loads)
            self.placed_since = [0] * self.ranks


def placement_from_env(environ: dict[str, str] | None = None, name: str = f"${ENV}") -> Placement:
    value = (environ if environ is not None else os.environ).get(ENV, Placement.LEAST_LOADED.value)
    try:
        return Placement(value)
    except ValueError:
        raise ValueError(f"{name} {value!r}: give one of {', '.join(p.value for p in Placement)}") from None


def router_of(scope: dict[str, Any]) -> ConversationRouter | None:
    """The app's router, built at its first request: None with one rank or placement off."""
    app_state = getattr(scope.get("app"), "state", None)
    if app_state is None:
        return None
    if hasattr(app_state, STATE_KEY):
        return getattr(app_state, STATE_KEY)
    engine = getattr(app_state, "engine_client", None)
    if engine is None:
        return None  # not ready: looked at again at the next request
    from marsched.serve.state import rank_count

    core = getattr(engine, "engine_core", None)
    ranks = rank_count(scope)
    try:
        placement = placement_from_env()
    except ValueError as error:  # marsched serve checks it; a hand-made launch may not have
        logger.warning("marsched: %s; placing conversations by least-loaded", error)
        placement = Placement.LEAST_LOADED
    router = None
    if ranks > 1 and placement is not Placement.OFF:
        if getattr(core, "client_count", 1) > 1:
            placement = Placement.HASH

        async def look() -> list[RankLoad]:
            from marsched.serve.metrics import MarsSnapshot
            from marsched.serve.state import ask_ranks

            ranks_state = await ask_ranks(scope, timeout_s=LOOK_TIMEOUT_S)
            return [RankLoad.from_state(MarsSnapshot.from_workers(workers).scheduler) for workers in ranks_state]

        router = ConversationRouter(ranks, placement, look)
    setattr(app_state, STATE_KEY, router)
    return router


def _given_rank(headers: list[tuple[bytes, bytes]]) -> int | None:
    for key, value in headers:
        if key.lower() == HEADER:
            try:
                return int(value)
            except ValueError:
                return None
    return None


class DataParallelAffinityMiddleware:
    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope.get("type") != "http" or scope.get("method") != "POST" or scope.get("path") not in PATHS:
            await self.app(scope, receive, send)
            return
        router = router_of(scope)
        if router is None:
            await self.app(scope, receive, send)
            return
        raw = await read_body(receive)
        if raw is None:  # the client left before its body arrived
            return
        body = parsed(raw)
        turn, history = named_turn(body), None
        if turn is None and (history := history_of(scope["path"], body)) is not None:
            turn = Turn(router.inferred(history), False)
        if turn is None:
            await self.app(scope, replay_body(raw, receive), send)
            return
        headers = scope.get("headers", [])
        rank = await router.rank_for(turn, _given_rank(headers))
        routed = dict(scope, headers=[(k, v) for k, v in headers if k.lower() != HEADER]
                      + [(HEADER, str(rank).encode())])
        router.in_flight[rank] += 1
        if history is not None:
            send, answer = _watch_answer(send)
        try:
            await self.app(routed, replay_body(raw, receive), send)
        finally:
            router.in_flight[rank] -= 1
            if history is not None:
                router.turn_ended(turn.conversation, history, answer())
            if turn.last:
                router.forget(turn.conversation)


def _watch_answer(send: Any) -> tuple[Any, Any]:
    """`send`, and whether the last body message of an HTTP 200 response has gone through it."""
    status, done = 0, False

    async def sending(message: dict[str, Any]) -> None:
        nonlocal status, done
        await send(message)
        if message.get("type") == "http.response.start":
            status = int(message.get("status", 0))
        elif message.get("type") == "http.response.body" and not message.get("more_body"):
            done = status == 200

    return sending, lambda: done

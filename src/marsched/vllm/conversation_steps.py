"""A conversation's KV between its turns, as the scheduler runs it (`retention.py` keeps the blocks).

A finished turn of a conversation (a request naming one) keeps its KV by the retention rule's
strategy until the follow-up arrives; kept conversations give way when vLLM cannot allocate a
request's blocks (`_allocate_giving_way`); vLLM's abort path carries releases (`marsched-release:<conversation>`),
the front end's stop-string ends (`marsched-stopped:<request id>`), which are finished turns,
the tools a finished turn called (`marsched-tool:<conversation>\\x1f<names>`, `tool_hints.py`), and
the API server's length predictions (`marsched-predicted:<rid>\\x1f<tokens>`, `told_predictions.py`).

A request that names no conversation may still be a turn of one (`follow_ups.py`): its prompt
continues a recently finished turn's prompt and reply. It is then that conversation's turn in
everything above (retention, the program's clocks, the gap per tool). Its finished turn keeps
nothing until the API server says its reply called tools (`marsched-called:<rid>\x1f<names>`,
`tool_hints.py`): then the pause begins, and its KV is kept as a named turn's is, if its blocks
are still in vLLM's prefix cache.

The predicted gap of a turn (`GapEstimator`): the client's `tool_s`; else the estimate of the
tools the turn called, once the API server has said which (the turn is then decided again,
where its strategy can still change: `ConversationKeeper.change`); until then, the estimate of
the conversation's previous tool; else the global one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

from vllm.logger import init_logger
from vllm.v1.request import Request, RequestStatus

from marsched.policy import EngineLoad, Strategy
from marsched.policy.retention import GapSource, RetentionMode
from marsched.vllm.follow_ups import INFERRED_PREFIX, PendingTurn, prompt_tail, still_cached
from marsched.vllm.retention import RELEASE_PREFIX
from marsched.vllm.signals import wake_engine
from marsched.vllm.stop_strings import STOPPED_PREFIX, split_marked
from marsched.vllm.told_predictions import PREDICTED_PREFIX, read_prediction
from marsched.vllm.tool_hints import CALLED_PREFIX, TOOL_PREFIX, read_called, read_hint
from marsched.vllm.tracked import RetentionDecision, Tracked

logger = init_logger(__name__)
ENDED = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)  # a turn that ended by itself


@dataclass(frozen=True, slots=True)
class KeptDecision:
    """What a kept turn was decided from (`Kept.decided`), to decide it again when its tools are told."""

    rid: str  # the caller's id: its info in `_done`
    context_tokens: int
    open: bool  # the `policy` rule decided from a predicted gap (not the client's `tool_s`, not a forced strategy)


class ConversationSteps:
    """Mixed into `MarsSchedulerMixin`, which sets up `_keeper`, `_retention`, `_gaps`, `_tools`, `_programs`,
    `_follow_ups` (None: no inference)."""

    _follow_ups: Any = None  # `FollowUps`, once the scheduler sets it up

    def finish_requests(self, request_ids: Any, finished_status: RequestStatus) -> list[Request]:
        """vLLM's abort path, also carrying releases: `marsched-release:<conversation>` ends that
        conversation's retention (a front end whose client went away, or a last turn),
        `marsched-stopped:<request id>` says that the request ended on a stop string, and
        `marsched-tool:<conversation>\\x1f<names>` which tools a conversation's finished turn called,
        and `marsched-predicted:<rid>\\x1f<tokens>` a request's predicted length."""
        if request_ids is None:
            return super().finish_requests(request_ids, finished_status)
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        ids, released = split_marked(ids, RELEASE_PREFIX)
        for conversation in released:
            self._programs.ended(conversation)
            if self._keeper.release(conversation) and self._swapper is not None:
                self._swapper.snapshot_dirty = True  # a step publishes the counters, also on an idle engine
        ids, hints = split_marked(ids, TOOL_PREFIX)
        for hint in hints:
            try:
                self._tool_hint(hint)
            except Exception:  # noqa: BLE001 - a hint only sharpens a prediction; the engine goes on
                logger.exception("marsched: a tool hint failed")
        ids, called = split_marked(ids, CALLED_PREFIX)
        for text in called:
            try:
                self._reply_called(text)
            except Exception:  # noqa: BLE001 - a kept turn is an optimisation; the engine goes on
                logger.exception("marsched: keeping a turn whose reply called tools failed")
        ids, told = split_marked(ids, PREDICTED_PREFIX)
        for text in told:
            read = read_prediction(text)
            if read is None:
                continue
            try:
                self._told_prediction(*read)
            except Exception:  # noqa: BLE001 - a told number only sharpens a ranking; the engine goes on
                logger.exception("marsched: a told length prediction failed")
        if told and self._swapper is not None:
            self._swapper.snapshot_dirty = True  # a step publishes the counters, also on an idle engine
        ids, stopped = split_marked(ids, STOPPED_PREFIX)
        finished: list[Request] = []
        if stopped and finished_status == RequestStatus.FINISHED_ABORTED:
            # The front end ended these on a stop string (`stop_strings.py`): they finished.
            ended = set(stopped)
            finished = super().finish_requests([rid for rid in ids if rid in ended], RequestStatus.FINISHED_STOPPED)
            ids = [rid for rid in ids if rid not in ended]
        return finished + super().finish_requests(ids, finished_status)

    def _keeps_turn(self, request: Request, tracked: Tracked | None) -> bool:
        return (tracked is not None and tracked.conversation is not None and tracked.retain and not tracked.inferred
                and request.status in ENDED)

    # --- a conversation recognised from the prompt (`follow_ups.py`) --------------------

    def _infer_conversation(self, request: Request, tracked: Tracked) -> bool:
        """A request naming no conversation: the conversation its prompt continues, or a new one.
        Returns whether it continues one (a follow-up)."""
        if self._follow_ups is None:
            return False
        hashes = request.block_hashes
        conversation = self._follow_ups.match(hashes, request.num_prompt_tokens, request.prompt_token_ids)
        tracked.inferred, tracked.prompt_blocks = True, len(hashes)
        tracked.conversation = conversation or INFERRED_PREFIX + request.request_id
        if conversation is not None:
            self._follow_ups.continued(conversation)  # a late word on the previous reply keeps nothing
        return conversation is not None

    def _inferred_turn_ended(self, request: Request, tracked: Tracked) -> None:
        """An inferred conversation's turn finishes: its follow-up is looked for, its program goes on,
        and its blocks wait in vLLM's prefix cache for the word that its reply called tools."""
        now = time.monotonic()
        conversation = tracked.conversation
        tail = prompt_tail(request.all_token_ids, tracked.prompt_tokens, tracked.prompt_blocks, self.cache_config.block_size)
        self._follow_ups.finished(conversation, tracked.prompt_tokens, tracked.prompt_blocks, request.block_hashes, now,
                                  list(tail))
        self._keeper.ended(conversation, now)
        self._tools.ended(conversation)
        self._programs.adopt(conversation, tracked.prompt_tokens, tracked.arrival_t)
        groups = self.kv_cache_manager.get_blocks(request.request_id).blocks
        blocks = list(groups[0]) if len(groups) == 1 else []  # one KV group: full attention
        full = min(request.num_computed_tokens // self.cache_config.block_size, len(blocks))
        blocks = blocks[:full]
        self._follow_ups.wait_for_reply(PendingTurn(
            conversation, tracked.rid, request.request_id, list(request.all_token_ids[:full * self.cache_config.block_size]),
            request.num_computed_tokens, blocks, [b.block_hash for b in blocks], now))

    def _reply_called(self, text: str) -> None:
        """The API server says an inferred turn's reply called tools: the pause begins, and the turn's
        KV is kept as the retention rule decides from those tools' gap, if vLLM still caches it."""
        read = read_called(text)
        if read is None or self._follow_ups is None:
            return
        rid, tools = read
        turn = self._follow_ups.replied(rid)
        if turn is None:
            return
        conversation = turn.conversation
        self._tools.hinted(conversation, tools)
        blocks = still_cached(turn.blocks, turn.hashes)
        gap_s = self._gaps.predict(None, tools)
        block_size = self.cache_config.block_size
        context = min(turn.context_tokens, len(blocks) * block_size)
        strategy, hold_s = self._retention_choice(context, gap_s, self._load(),
                                                  self._host_free_tokens() >= context)
        kept = self._keeper.keep(conversation, turn.request_id, turn.tokens, context, blocks, strategy,
                                 turn.end_t, hold_s, self._programs.arrival(conversation))
        decision = RetentionDecision(strategy if kept is not None else Strategy.DISCARD, gap_s, GapSource.HINT, tools)
        info = self._done.get(rid)
        if info is not None:
            info["retention"] = decision.to_dict()
            self._changed.add(rid)
        if kept is not None:
            kept.decided = KeptDecision(rid, context, False)
            self._arm_expiry(time.monotonic())
        if self._swapper is not None:
            self._swapper.snapshot_dirty = True  # a step publishes it, and sends a copy a Swap asks for

    def _keep_conversation(self, request: Request, tracked: Tracked) -> None:
        """A turn of a conversation ends: keep its KV as the retention rule decides."""
        now = time.monotonic()
        groups = self.kv_cache_manager.get_blocks(request.request_id).blocks
        blocks = list(groups[0]) if len(groups) == 1 else []  # one KV group: full attention
        tools = self._tools.ended(tracked.conversation)  # its previous tool, until the hint comes
        gap_s = self._gaps.predict(tracked.tool_s, tools)
        source = (GapSource.STATED if tracked.tool_s is not None else GapSource.PREVIOUS if tools
                  else GapSource.GLOBAL)
        load = self._load()
        forced = tracked.override is not None and self._retention.mode is RetentionMode.POLICY
        if forced:
            strategy, hold_s = tracked.override, self._retention.limit_s
        else:
            strategy, hold_s = self._retention_choice(request.num_computed_tokens, gap_s, load,
                                                      self._can_swap(request, load))
        tracked.retention = RetentionDecision(strategy, gap_s, source, tools if source is GapSource.PREVIOUS else ())
        kept = self._keeper.keep(tracked.conversation, request.request_id, request.all_token_ids,
                                 request.num_computed_tokens, blocks, strategy, now, hold_s,
                                 self._programs.arrival(tracked.conversation))
        if kept is not None:
            # The client's tool_s wins, a forced strategy stays, and the other rules do not read the gap.
            open_ = not forced and tracked.tool_s is None and self._retention.mode is RetentionMode.POLICY
            kept.decided = KeptDecision(tracked.rid, request.num_computed_tokens, open_)
            self._arm_expiry(now)

    def _retention_choice(self, context_tokens: int, gap_s: float, load: EngineLoad,
                          can_swap: bool) -> tuple[Strategy, float]:
        """The retention rule's strategy and hold time; a Swap that cannot be made falls back to
        the cheaper of the others."""
        choice = self._retention.decide(self.mars_policy, context_tokens, gap_s, load)
        strategy = choice.strategy
        if strategy is Strategy.SWAP and not can_swap:
            strategy = self.mars_policy.strategy_for_gap(context_tokens, gap_s, replace(load, host_free_tokens=0))
        return strategy, choice.hold_s

    def _tool_hint(self, hint: str) -> None:
        """The API server says which tools a conversation's finished turn called: remember them
        for the gap to its follow-up, and decide a kept turn again with their estimate."""
        read = read_hint(hint)
        if read is None or not self._tools.hinted(*read):
            return
        conversation, tools = read
        kept = self._keeper.kept.get(conversation)
        decided: KeptDecision | None = kept.decided if kept is not None else None
        if decided is None or not decided.open:
            return
        gap_s = self._gaps.predict(None, tools)
        wanted, _ = self._retention_choice(decided.context_tokens, gap_s, self._load(),
                                           self._host_free_tokens() >= len(kept.tokens))
        strategy = self._keeper.change(conversation, wanted)
        decision = RetentionDecision(strategy, gap_s, GapSource.HINT, tools, redecided=True)
        info = self._done.get(decided.rid)
        if info is not None:
            info["retention"] = decision.to_dict()
            self._changed.add(decided.rid)
        if self._swapper is not None:
            self._swapper.snapshot_dirty = True  # a step publishes it, and sends a copy a Swap asks for

    def _arm_expiry(self, now: float) -> None:
        if self._input_queue is not None:
            self._keeper.arm(now, lambda: wake_engine(self._input_queue))

    def _let_kept_give_way(self) -> None:
        """Have vLLM's block allocation free kept turns' blocks before it gives up (`_allocate_giving_way`)."""
        self._allocate_slots = self.kv_cache_manager.allocate_slots
        self.kv_cache_manager.allocate_slots = self._allocate_giving_way

    def _allocate_giving_way(self, request: Request, *args: Any, **kwargs: Any) -> Any:
        """vLLM's `allocate_slots`; where the blocks are short, kept turns give theirs up one by one
        (`ConversationKeeper.relieve`) and the allocation is tried again: before vLLM preempts a running
        request, or leaves a waiting one in the queue. vLLM counts what the request needs (its prefix
        hit, its whole prompt at admission), so no more is given up than makes it fit; the simulator
        frees pins at the same points (`sim/engine.py`). A failed try changes nothing in vLLM."""
        blocks = self._allocate_slots(request, *args, **kwargs)
        while blocks is None and self._give_way(request.request_id):
            blocks = self._allocate_slots(request, *args, **kwargs)
        return blocks

    def _give_way(self, rid: str) -> bool:
        """Free at least one block for request `rid` from what is kept; whether anything was given up."""
        if not (self._keeper.kept or self._keeper.claims):
            return False
        try:
            free = self.kv_cache_manager.block_pool.get_num_free_blocks()
            released = self._keeper.relieve(free, free + 1, rid)
        except Exception:  # noqa: BLE001 - kept conversations are an optimisation; the allocation goes on
            logger.exception("marsched: giving kept blocks up failed")
            return False
        if released and self._swapper is not None:
            self._swapper.snapshot_dirty = True
        return released > 0

    def _tend_kept(self, now: float) -> None:
        """Each step: end expired retentions; an inferred conversation not continued in its window ends."""
        if self._follow_ups is not None:
            for conversation in self._follow_ups.expire(now):
                self._programs.ended(conversation)
        if self._keeper.expire(now) and self._swapper is not None:
            # Often the only step of an idle engine: without this it would not publish the counters,
            # and /marsched/state would show the ended retentions as kept until the next request.
            self._swapper.snapshot_dirty = True
        self._arm_expiry(now)

"""A conversation's KV between its turns, as the scheduler runs it (`retention.py` keeps the blocks).

A finished turn of a conversation (a request naming one) keeps its KV by the retention rule's
strategy until the follow-up arrives; kept conversations give way when the head of the waiting
queue does not fit; vLLM's abort path carries releases (`marsched-release:<conversation>`) and
the front end's stop-string ends (`marsched-stopped:<request id>`), which are finished turns.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from vllm.v1.request import Request, RequestStatus

from marsched.policy import Strategy
from marsched.vllm.retention import RELEASE_PREFIX
from marsched.vllm.signals import wake_engine
from marsched.vllm.stop_strings import STOPPED_PREFIX, split_marked
from marsched.vllm.tracked import Tracked


class ConversationSteps:
    """Mixed into `MarsSchedulerMixin`, which sets up `_keeper`, `_retention`, `_gaps`."""

    def finish_requests(self, request_ids: Any, finished_status: RequestStatus) -> list[Request]:
        """vLLM's abort path, also carrying releases: `marsched-release:<conversation>` ends that
        conversation's retention (a front end whose client went away, or a last turn), and
        `marsched-stopped:<request id>` says that the request ended on a stop string."""
        if request_ids is None:
            return super().finish_requests(request_ids, finished_status)
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        ids, released = split_marked(ids, RELEASE_PREFIX)
        for conversation in released:
            if self._keeper.release(conversation) and self._swapper is not None:
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
        return (tracked is not None and tracked.conversation is not None and tracked.retain
                and request.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED))

    def _keep_conversation(self, request: Request, tracked: Tracked) -> None:
        """A turn of a conversation ends: keep its KV as the retention rule decides."""
        now = time.monotonic()
        groups = self.kv_cache_manager.get_blocks(request.request_id).blocks
        blocks = list(groups[0]) if len(groups) == 1 else []  # one KV group: full attention
        gap_s = self._gaps.predict(tracked.tool_s)
        load = self._load()
        if tracked.override is not None and self._retention.name == "policy":
            strategy, hold_s = tracked.override, self._retention.limit_s
        else:
            choice = self._retention.decide(self.mars_policy, request.num_computed_tokens, gap_s, load)
            strategy, hold_s = choice.strategy, choice.hold_s
        if strategy is Strategy.SWAP and not self._can_swap(request, load):
            strategy = self.mars_policy.strategy_for_gap(request.num_computed_tokens, gap_s,
                                                         replace(load, host_free_tokens=0))
        if self._keeper.keep(tracked.conversation, request.request_id, request.all_token_ids,
                             request.num_computed_tokens, blocks, strategy, now, hold_s) is not None:
            self._arm_expiry(now)

    def _arm_expiry(self, now: float) -> None:
        if self._input_queue is not None:
            self._keeper.arm(now, lambda: wake_engine(self._input_queue))

    def _tend_kept(self, now: float) -> None:
        """Each step: end expired retentions, and give way to the head of the queue if it does not fit."""
        self._keeper.expire(now)
        self._arm_expiry(now)
        if not self._keeper.kept or not len(self.waiting):
            return
        head = self.waiting.head_request()
        if head is None:
            return
        block_size = self.cache_config.block_size
        needed = -(-(head.num_tokens - head.num_computed_tokens + 1) // block_size)
        self._keeper.relieve(self.kv_cache_manager.block_pool.get_num_free_blocks(), needed)

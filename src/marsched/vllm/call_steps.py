"""A request's calls inside vLLM: the lifecycle driver's steps on vLLM's requests and KV blocks.

A resumable (streaming-input) request that stops at a tool call is paused by vLLM with its
blocks (Preserve); `_handle_stopped_request` starts the call through the driver, which frees the
blocks (Discard) or queues a copy to host (Swap, `kv_swap.py`) through this engine's side
(`keep`, `discard`, `swap_out`); `_update_request_as_session` (the next chunk) ends the call and
resumes the request on the device, in the waiting queue, or from host memory.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from vllm.v1.request import Request, RequestStatus

from marsched.policy import EngineLoad, RequestProgress
from marsched.vllm.metadata import ChunkMeta, PlannedSegment, decode, workload_request
from marsched.vllm.tracked import Kv, Tracked
from marsched.workload.model import ApiCall, ApiType

PAUSED = RequestStatus.WAITING_FOR_STREAMING_REQ


def with_length(plan: tuple[PlannedSegment, ...], segment: int, tokens: int) -> tuple[PlannedSegment, ...]:
    """`plan` with `tokens` as segment `segment`'s output length."""
    return plan[:segment] + (replace(plan[segment], output_tokens=tokens),) + plan[segment + 1:]


class CallSteps:
    """Mixed into `MarsSchedulerMixin`, which sets up `lifecycle`, `_tracked`, `_swapper`, `_keeper`, `_told`."""

    # --- the engine's side of the lifecycle (`marsched.lifecycle.EngineSide`) -----------

    def clock(self) -> float:
        return time.monotonic()

    def current_iteration(self) -> int:
        return self._iteration

    def load(self) -> EngineLoad:
        return self._load()

    def kv_blocks_in_use(self) -> tuple[int, int]:
        pool = self.kv_cache_manager.block_pool
        device_blocks = pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()  # less the null block
        host_tokens = self._swapper.host_tokens_used if self._swapper is not None else 0
        return device_blocks, -(-host_tokens // self.cache_config.block_size)

    def can_swap(self, tracked: Tracked) -> bool:
        request = self.requests.get(tracked.progress.request_id)
        return request is not None and self._can_swap(request, self._load())

    def _can_swap(self, request: Request, load: EngineLoad) -> bool:
        return (self._swapper is not None and len(self.kv_cache_manager.get_block_ids(request.request_id)) == 1
                and load.host_free_tokens >= request.num_computed_tokens)

    def keep(self, tracked: Tracked) -> None:
        tracked.kv = Kv.DEVICE

    def discard(self, tracked: Tracked) -> None:
        # num_computed_tokens stays: _update_request_as_session rebuilds the prompt with it.
        self._free_request_blocks(self.requests[tracked.progress.request_id])
        tracked.kv = Kv.DISCARDED

    def swap_out(self, tracked: Tracked) -> None:
        rid = tracked.progress.request_id
        request = self.requests[rid]
        tracked.saved_tokens = request.num_computed_tokens
        self._swapper.queue_swap_out(rid, self.kv_cache_manager.get_block_ids(rid)[0], tracked.saved_tokens)
        tracked.kv = Kv.SWAP_QUEUED

    def holds_preserved(self, tracked: Tracked) -> bool:
        rid = tracked.progress.request_id
        request = self.requests.get(rid)
        return (rid in self._tracked and request is not None and request.status == PAUSED
                and tracked.kv == Kv.DEVICE)

    # --- arrival and segments ---------------------------------------------------------

    def _on_arrival(self, request: Request) -> None:
        now = time.monotonic()
        meta = self._with_told(decode(request.sampling_params))
        plan = self._with_prediction(meta.plan if meta and meta.plan else (PlannedSegment(request.max_tokens),), meta)
        rid = (meta.request_id if meta else None) or request.request_id
        for planned in plan:  # a tool's stated duration is the estimate for its type until one is observed
            if planned.api_type is not None:
                self.mars_policy.predictor.api.declare(planned.api_type, planned.api_s, planned.return_tokens)
        # The workload request carries vLLM's internal id (unique); the caller's id goes to the trace.
        progress = RequestProgress(workload_request(request.request_id, request.num_prompt_tokens, plan, now),
                                   order_s=now)
        override = meta.strategy if meta and self.mars_config.allow_request_strategy else None
        tracked = Tracked(progress, rid, request.num_prompt_tokens, plan, now, now, override)
        if meta is not None and meta.predicted is not None and self.mars_config.front_end:
            tracked.front_end_predictions.add(meta.segment)
        elif meta is not None and meta.request_id is not None and self.mars_config.front_end:
            self._told.expect(meta.request_id, request.request_id)  # the API server's number may follow
        self._tracked[request.request_id] = tracked
        if meta is not None and meta.conversation is not None:
            tracked.conversation, tracked.tool_s, tracked.retain = meta.conversation, meta.tool_s, meta.retain
            follows = True
        else:  # no id: a follow-up is recognised by its prompt (`follow_ups.py`)
            follows = self._infer_conversation(request, tracked)
        if follows:
            conversation = tracked.conversation
            gap = self._keeper.claim(conversation, request.request_id, list(request.prompt_token_ids or ()), now)
            if gap is not None:  # the gap goes to the tools the previous turn called, when they are known
                self._gaps.observe(gap, self._tools.arrived(conversation, meta.tool if meta else None))
            # The turn's reply as the policy predicts it (the plan's length for a front-end prediction,
            # the online mean for a predictor that learns; never a bare `max_tokens`): its program's
            # outlook prices the turns to come with it until one has ended.
            segment = min(meta.segment if meta else 0, len(plan) - 1)
            predicted = self.mars_policy.predictor.predict(progress.request, segment).output_tokens
            self._programs.turn_arrives(conversation, progress, predicted)
        program = {} if tracked.conversation is None else {
            "program": tracked.conversation, "identity": "inferred" if tracked.inferred else "stated"}
        self.lifecycle.arrived(tracked, now, request.num_prompt_tokens, **program)
        self._sync(tracked, request)
        self._start_segment(tracked, "waiting")

    def _start_segment(self, tracked: Tracked, queue: str) -> None:
        """At arrival the request waits; at a later segment's start its call has just returned."""
        index = tracked.progress.segment_index
        source = "front-end" if index in tracked.front_end_predictions else "plan"
        self.lifecycle.start_segment(tracked, queue, source)
        tracked.predictions[index] = tracked.progress.predictions[index]

    def _with_prediction(self, plan: tuple[PlannedSegment, ...], meta: ChunkMeta | None) -> tuple[PlannedSegment, ...]:
        """The plan with the chunk's front-end prediction as its segment's length (learned predictor only)."""
        if meta is None or meta.predicted is None or not self.mars_config.front_end or meta.segment >= len(plan):
            return plan
        return with_length(plan, meta.segment, meta.predicted)

    def _with_told(self, meta: ChunkMeta | None) -> ChunkMeta | None:
        """The metadata of an arriving request, with the number the API server told before it
        (`told_predictions.py`) where it carries none."""
        if meta is None or meta.predicted is not None or not self.mars_config.front_end:
            return meta
        tokens = self._told.take(meta.request_id)
        return meta if tokens is None else replace(meta, predicted=tokens)

    def _told_prediction(self, rid: str, tokens: int) -> None:
        """The API server tells request `rid`'s predicted length after the request (`told_predictions.py`).
        A request still waiting for its first admission is predicted again and ranked anew; one
        admitted since can be ordered no more."""
        internal = self._told.told(rid, tokens)
        tracked = self._tracked.get(internal) if internal is not None else None
        request = self.requests.get(internal) if internal is not None else None
        if tracked is None or request is None:
            return
        progress = tracked.progress
        if (progress.ran_before or progress.segment_index != 0 or progress.segment.api is not None
                or request not in self.waiting):
            # Admitted, or a planned call whose strategy was fixed ahead from the plan's length.
            self._told.late += 1
            return
        self._told.while_waiting += 1
        tracked.plan = with_length(tracked.plan, 0, tokens)
        progress.request = workload_request(progress.request_id, tracked.prompt_tokens, tracked.plan, tracked.arrival_t)
        tracked.front_end_predictions.add(0)
        promoted = progress.promoted  # promoted requests go first whatever their key: leave them in their lane
        if not promoted:
            self.waiting.remove_request(request)  # its starvation count is kept in its progress
        try:
            self._sync(tracked, request)
            self._start_segment(tracked, "waiting")
            if tracked.conversation is not None:
                self._programs.turn_predicted(tracked.conversation, progress, progress.predictions[0].output_tokens)
        finally:  # whatever failed, the request stays in the queue
            if not promoted:
                self.waiting.add_request(request)

    # --- calls ------------------------------------------------------------------------

    def _handle_stopped_request(self, request: Request) -> bool:
        finished = super()._handle_stopped_request(request)
        tracked = self._tracked.get(request.request_id)
        if tracked is not None and not finished and request.status == PAUSED:
            try:
                tracked.paused_t = time.monotonic()
                if tracked.progress.segment.api is not None:
                    self._start_call(request, tracked, apply=True)
            except Exception as error:  # noqa: BLE001
                self._fail(request, error, "API call start")
        return finished

    def _start_call(self, request: Request, tracked: Tracked, apply: bool) -> None:
        """A planned call begins (`apply=False`: the next chunk is already here; the KV stays)."""
        progress = tracked.progress
        self._sync(tracked, request)
        tracked.in_call = True
        self._in_call[progress.request_id] = tracked
        self.lifecycle.start_call(tracked, request.num_computed_tokens,
                                  progress.predictions[progress.segment_index].api_duration_s, apply)

    def _left_call(self, tracked: Tracked) -> None:
        tracked.in_call = False
        self._in_call.pop(tracked.progress.request_id, None)

    def _reconsider_paused(self) -> None:
        self.lifecycle.reconsider_paused()

    def _update_request_as_session(self, session: Request, update: Any) -> None:
        tracked = self._tracked.get(session.request_id)
        if tracked is None or session.request_id in self._failed:
            return super()._update_request_as_session(session, update)
        was_paused = session.status == PAUSED
        now = time.monotonic()
        try:
            self._before_resume(session, tracked, now)
        except Exception as error:  # noqa: BLE001
            self._fail(session, error, "next input chunk")
        # vLLM's own update always runs, so that its queues and counters stay consistent.
        super()._update_request_as_session(session, update)
        if session.request_id in self._failed:
            return
        try:
            self._after_resume(session, tracked, update, was_paused, now)
        except Exception as error:  # noqa: BLE001
            self._fail(session, error, "next input chunk")

    def _before_resume(self, session: Request, tracked: Tracked, now: float) -> None:
        rid = session.request_id
        if not tracked.in_call:  # unplanned call, or the chunk came before the segment ended
            if tracked.paused_t is None:
                tracked.paused_t = now
            self._start_call(session, tracked, apply=False)
        if tracked.kv == Kv.SWAP_QUEUED:  # back before the copy ran: keep the device blocks
            self._swapper.cancel_swap_out(rid)
            tracked.kv = Kv.DEVICE

    def _after_resume(self, session: Request, tracked: Tracked, update: Any, was_paused: bool, now: float) -> None:
        rid = session.request_id
        progress = tracked.progress
        call = progress.segment.api
        returned = max(len(update.prompt_token_ids or ()) - 1, 0)  # chunk = [last token] + return
        duration = now - (progress.api_started_s or now)
        observed = ApiCall(call.api_type, duration, returned) if call is not None and was_paused else None
        self.lifecycle.call_returned(tracked, observed, returned)
        self._left_call(tracked)
        tracked.paused_t = None
        self.lifecycle.begin_next_segment(tracked)
        self._extend_plan(tracked, session)
        self._sync(tracked, session)
        self._start_segment(tracked, "paused")
        where = {Kv.DISCARDED: "waiting", Kv.HOST: "host"}.get(tracked.kv, "device")
        self.lifecycle.resumed(tracked, where)
        if where == "device":
            # Kv.SWAP_OUT (async scheduling only): the copy is in flight; update_from_output
            # keeps the blocks and drops the copy.
            return
        session.num_computed_tokens = 0
        if tracked.kv == Kv.DISCARDED:
            # Faithful recompute: do not read the freed (still hashed) blocks back.
            tracked.restore_skip_prefix = session.skip_reading_prefix_cache
            session.skip_reading_prefix_cache = True
        else:
            # A swapped request must read the connector's hit (vLLM zeroes it otherwise).
            self._swapper.expect_load[rid] = tracked.saved_tokens
        progress.computed_tokens = 0
        self.kv_holding_waiting.remove_request(session)
        self.waiting.add_request(session)

    def _extend_plan(self, tracked: Tracked, session: Request) -> None:
        """Take the plan the chunk carries; add a segment if the request calls more than planned."""
        progress = tracked.progress
        meta = decode(session.sampling_params)
        plan = self._with_prediction(meta.plan if meta and meta.plan else tracked.plan, meta)
        if meta is not None and meta.predicted is not None and self.mars_config.front_end:
            tracked.front_end_predictions.add(meta.segment)
        while len(plan) <= progress.segment_index:
            last = plan[-1]
            plan = plan[:-1] + (PlannedSegment(last.output_tokens, last.api_type or ApiType.OTHER, last.api_s,
                                               last.return_tokens), PlannedSegment(session.max_tokens))
        if plan != tracked.plan:
            tracked.plan = plan
            progress.request = workload_request(progress.request_id, tracked.prompt_tokens, plan, tracked.arrival_t)
        if meta and meta.strategy is not None and self.mars_config.allow_request_strategy:
            tracked.override = meta.strategy

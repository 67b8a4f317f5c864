"""`MarsScheduler`: vLLM's V1 scheduler taking its decisions from `marsched.policy`.

Load it with `scheduler_cls="marsched.vllm.MarsScheduler"` (`--scheduler-cls` on
`vllm serve`); choose the policy with `additional_config={"marsched": {...}}`
(`marsched.vllm.config.MarsConfig`).

What the policy decides, and where it is plugged in (vLLM 0.32; every private name
used is listed in docs/vllm-internals.md):

- waiting order: `self.waiting` is a `RankedRequestQueue` over the policy's
  `WaitingQueue` (keys, refresh every k iterations, starvation promotion);
- preemption victim: vLLM preempts `self.running[-1]`; before each step `running`
  is sorted so that the last one is the lowest-ranked unprotected request
  (`policy.victim_key`, protection from starvation promotion);
- each call's strategy: a resumable request that stops (tool call) is paused by
  vLLM with its blocks (Preserve); `_handle_stopped_request` asks the policy and
  frees the blocks (Discard) or queues a copy to host (Swap, `kv_swap.py`);
  `_update_request_as_session` (the next chunk) restores the request;
- between a conversation's turns (requests naming a `conversation`, the OpenAI way of
  calling tools): `_free_request` keeps the finished turn's KV by the retention rule's
  strategy until the follow-up arrives (`retention.py`).

The logic is in `MarsSchedulerMixin`; `MarsScheduler` puts it on vLLM's
`AsyncScheduler`, which also runs correctly with synchronous execution (on CPU
vLLM forces that), so one class serves both.

Faults: an exception in our code or in the policy while handling one request
(metadata that slipped past the front end's check, a policy error for its values)
ends that request, not the engine: it is logged, the request is finished with
`FINISHED_ERROR` at the start of the next step (vLLM answers its client with an
error, like a grammar or KV-load failure) and its memory is freed. Faults outside
any one request's handling still propagate.
"""

from __future__ import annotations

import math
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Any

from vllm.logger import init_logger
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
from vllm.v1.request import Request, RequestStatus, StreamingUpdate

from marsched.policy import Admission, EngineLoad, KvOutlook, RequestProgress, Strategy, StrategyAssignment
from marsched.predict import SegmentPrediction
from marsched.vllm.config import MarsConfig
from marsched.vllm.kv_swap import HostSwapConnector, SwapMeta
from marsched.vllm.metadata import ChunkMeta, MetadataError, PlannedSegment, decode, workload_request
from marsched.vllm.ranked_queue import RankedRequestQueue
from marsched.vllm.retention import RELEASE_PREFIX, HOST_KEY_PREFIX, ConversationKeeper
from marsched.vllm.signals import engine_input_queue, wake_engine, wake_engine_on_shutdown_signals
from marsched.vllm.trace import open_trace
from marsched.metrics.trace import SCHEMA_VERSION, event_fields
from marsched.policy.retention import GapEstimator
from marsched.policy.trace_fields import declaration, key_basis
from marsched.workload.model import ApiCall, ApiType

logger = init_logger(__name__)

_PAUSED = RequestStatus.WAITING_FOR_STREAMING_REQ
_LIVE: list[weakref.ref] = []  # schedulers of this process, for MarsWorkerExtension
_DONE_KEPT = 10_000  # finished requests whose info stays readable


def live_schedulers() -> list["MarsSchedulerMixin"]:
    return [s for s in (ref() for ref in _LIVE) if s is not None]


class Kv:
    """Where a paused request's KV cache is."""

    DEVICE = "device"
    DISCARDED = "discarded"
    SWAP_QUEUED = "swap-queued"  # copy asked for, not yet sent to the worker
    SWAP_OUT = "swap-out"  # copy sent with this step; blocks freed when the step's output arrives
    HOST = "host"


@dataclass(eq=False)
class Tracked:
    progress: RequestProgress
    rid: str  # the caller's id, for the trace
    prompt_tokens: int
    plan: tuple[PlannedSegment, ...]
    arrival_t: float
    wait_since_t: float
    override: Strategy | None = None
    kv: str = Kv.DEVICE
    in_call: bool = False
    paused_t: float | None = None
    saved_tokens: int = 0
    first_token_t: float = math.nan
    restore_skip_prefix: bool | None = None
    closing: bool = False
    preemptions: int = 0
    victim_key: float = 0.0
    conversation: str | None = None  # the conversation this request is a turn of
    tool_s: float | None = None  # the client's estimate of the time until the next turn
    retain: bool = True
    strategies: list[str] = field(default_factory=list)  # the strategy each call ran under
    predictions: dict[int, SegmentPrediction] = field(default_factory=dict)  # at each segment's start
    front_end_predictions: set[int] = field(default_factory=set)  # segments whose length the front end predicted


class MarsSchedulerMixin:
    """The MARS logic; mix in before a vLLM `Scheduler` class."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # vLLM's shutdown relies on its SIGTERM handler running; see signals.py.
        input_queue = self._input_queue = engine_input_queue()
        if input_queue is not None:
            wake_engine_on_shutdown_signals(input_queue)
        self.mars_config = MarsConfig.from_vllm_config(self.vllm_config)
        self.mars_policy = self.mars_config.build_policy(token_budget=self.max_num_scheduled_tokens)
        self.mars_trace = open_trace(self.mars_config.trace_path)
        self._iteration = 0
        self._tau = self.mars_policy.cost.iteration_time(1)
        self._last_step_t: float | None = None
        self._running_kv: int | None = None
        self._outlooks: dict[str, KvOutlook] = {}  # admission's view of requests, this step (`_outlook`)
        self._tracked: dict[str, Tracked] = {}
        self._done: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._paused_preserved: dict[str, Request] = {}
        self._swap_inflight: dict[str, tuple[Any, int]] = {}
        self._changed: set[str] = set()  # requests whose info changed since the last step
        self._failed: dict[str, Request] = {}  # a fault of ours: ended with an error at the next step
        self._error_outputs: list[Request] = []  # ended with an error: told to the client at this step's output
        assert not self.waiting, "the waiting queue is replaced before any request arrives"
        self.waiting = RankedRequestQueue(self.mars_policy, self._progress_of, self._load, lambda: self._iteration,
                                          time.monotonic, self._admits, on_fault=self._fail)
        self._swapper = self.connector if isinstance(self.connector, HostSwapConnector) else None
        self._retention = self.mars_config.retention_rule()
        self._keeper = ConversationKeeper(self.kv_cache_manager.block_pool, self.cache_config.block_size, self._swapper)
        self._gaps = GapEstimator()
        self._promotions = 0
        if not self.cache_config.enable_prefix_caching:
            logger.warning("marsched: prefix caching is off, so a conversation's Preserve retention keeps nothing "
                           "(its follow-up could not find the blocks); Swap retention still works")
        _LIVE.append(weakref.ref(self))
        block_tokens = self.cache_config.block_size
        self._emit("run", None, schema_version=SCHEMA_VERSION, engine="vllm", policy=declaration(self.mars_policy),
                   device_blocks=self.kv_cache_manager.block_pool.num_gpu_blocks - 1,
                   host_blocks=self.mars_config.host_swap_tokens // block_tokens if self._swapper else 0,
                   block_tokens=block_tokens)

    # --- state the policy reads -------------------------------------------------------

    def _load(self) -> EngineLoad:
        if self._running_kv is None:
            self._running_kv = sum(r.num_computed_tokens for r in self.running)
        host_free = 0
        if self._swapper is not None:
            host_free = max(self.mars_config.host_swap_tokens - self._swapper.host_tokens_used, 0)
        return EngineLoad(time.monotonic(), self._running_kv, self._tau, host_free)

    def _admits(self, request: Request) -> bool:
        """The policy's admission rule for the head of the waiting queue, against the running batch."""
        if self.mars_policy.admission is Admission.GREEDY or request.request_id not in self._tracked:
            return True
        try:
            return self._admits_by_peak(request)
        except Exception as error:  # noqa: BLE001 - find the request at fault; the rest go on
            culprits = [r for r in (request, *self.running) if r.request_id in self._tracked
                        and not self._outlook_ok(r)]
            for culprit in culprits:
                self._fail(culprit, error, "admission")
            return request not in culprits  # a fault elsewhere: admit greedily

    def _outlook_ok(self, request: Request) -> bool:
        try:
            self.mars_policy.kv_outlook(self._progress_of(request))
        except Exception:  # noqa: BLE001
            return False
        return True

    def _admits_by_peak(self, request: Request) -> bool:
        running = [self._outlook(r) for r in self.running if r.request_id in self._tracked]
        pool = self.kv_cache_manager.block_pool
        block_tokens = self.cache_config.block_size
        capacity_tokens = (pool.num_gpu_blocks - 1) * block_tokens  # the null block is never free
        used_tokens = capacity_tokens - pool.get_num_free_blocks() * block_tokens
        batch_tokens = sum(-(-r.num_computed_tokens // block_tokens) * block_tokens for r in self.running)
        return self.mars_policy.admits_outlooks(self._outlook(request), running, max(used_tokens - batch_tokens, 0),
                                                capacity_tokens, block_tokens)

    def _outlook(self, request: Request) -> KvOutlook:
        """A request's KV outlook, once per step: vLLM's waiting loop asks for admission at every
        look at the queue, and within a step nothing the outlook reads changes (the running
        requests were synced when the step began, a waiting one when it was pushed; scheduling
        moves only `num_computed_tokens`, which the outlook does not read)."""
        outlook = self._outlooks.get(request.request_id)
        if outlook is None:
            outlook = self._outlooks[request.request_id] = self.mars_policy.kv_outlook(
                self._tracked[request.request_id].progress)
        return outlook

    def _progress_of(self, request: Request) -> RequestProgress:
        tracked = self._tracked[request.request_id]
        self._sync(tracked, request)
        return tracked.progress

    @staticmethod
    def _sync(tracked: Tracked, request: Request) -> None:
        progress = tracked.progress
        progress.context_tokens = request.num_tokens
        progress.computed_tokens = request.num_computed_tokens
        progress.generated = request.num_output_tokens

    def _emit(self, event: str, tracked: Tracked | None, **fields: Any) -> None:
        if tracked is not None:
            self._changed.add(tracked.progress.request_id if tracked.rid not in self._done else tracked.rid)
            if self._swapper is not None:
                self._swapper.snapshot_dirty = True
        if self.mars_trace.enabled:
            try:
                self.mars_trace.emit(event, time.monotonic(), tracked.rid if tracked else None,
                                     **self._common_fields(event, tracked, fields))
            except (OSError, ValueError) as error:  # a full disk must not stop the engine: stop tracing
                logger.error("marsched: writing the event trace failed (%s); tracing stops here", error)
                broken, self.mars_trace = self.mars_trace, open_trace(None)
                try:
                    broken.close()
                except OSError:
                    pass

    def _common_fields(self, event: str, tracked: Tracked | None, fields: dict[str, Any]) -> dict[str, Any]:
        """The fields every event carries (`metrics/trace.schema.json`), then the event's own."""
        pool = self.kv_cache_manager.block_pool
        device_blocks = pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()  # less the null block
        host_tokens = self._swapper.host_tokens_used if self._swapper is not None else 0
        segment = tracked.progress.segment_index if tracked is not None else None
        return event_fields(event, self._iteration, segment, fields, device_blocks,
                            -(-host_tokens // self.cache_config.block_size))

    def _emit_assignments(self, tracked: Tracked, since: int, queue: str = "paused") -> None:
        for a in tracked.progress.assignments[since:]:
            self._emit("assign_strategy", tracked, segment=a.segment_index, queue=queue, strategy=a.strategy.value,
                       reason=a.reason, context_tokens=a.context_tokens, api_s=a.api_s)

    # --- arrival and segments ---------------------------------------------------------

    def add_request(self, request: Request) -> None:
        existing = self.requests.get(request.request_id)
        try:
            if existing is None:
                self._on_arrival(request)
            elif StreamingUpdate.from_request(request) is None:  # the session's closing message
                tracked = self._tracked.get(request.request_id)
                if tracked is not None:
                    tracked.closing = True
            super().add_request(request)
        except Exception as error:  # noqa: BLE001 - this request ends; the engine goes on
            self._fail(existing or request, error, "arrival" if existing is None else "next input chunk")

    def _on_arrival(self, request: Request) -> None:
        now = time.monotonic()
        meta = decode(request.sampling_params)
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
        self._tracked[request.request_id] = tracked
        if meta is not None and meta.conversation is not None:
            tracked.conversation, tracked.tool_s, tracked.retain = meta.conversation, meta.tool_s, meta.retain
            gap = self._keeper.claim(meta.conversation, request.request_id, list(request.prompt_token_ids or ()), now)
            if gap is not None:
                self._gaps.observe(gap)
        self._emit("arrive", tracked, arrival_s=now, prompt_tokens=request.num_prompt_tokens, segments=len(plan))
        self._sync(tracked, request)
        self._start_segment(tracked)

    def _start_segment(self, tracked: Tracked) -> None:
        progress = tracked.progress
        before = len(progress.assignments)
        load = self._load()
        self.mars_policy.start_segment(progress, load)
        index = progress.segment_index
        if tracked.override is not None and progress.segment.api is not None:
            prediction = progress.predictions[index]
            progress.assign(StrategyAssignment(index, tracked.override, load.now_s,
                                               progress.context_tokens + prediction.output_tokens,
                                               prediction.api_duration_s, "request"))
        tracked.predictions[index] = progress.predictions[index]
        prediction = progress.predictions[index]
        # At arrival the request waits; at a later segment's start its call has just returned.
        queue = "waiting" if index == 0 else "paused"
        self._emit("predict", tracked, segment=index, queue=queue, output_tokens=prediction.output_tokens,
                   api_s=prediction.api_duration_s, return_tokens=prediction.api_return_tokens,
                   predictor=self.mars_policy.predictor.length.name,
                   source="front-end" if index in tracked.front_end_predictions else "plan")
        self._emit_assignments(tracked, before, queue)

    def _with_prediction(self, plan: tuple[PlannedSegment, ...], meta: ChunkMeta | None) -> tuple[PlannedSegment, ...]:
        """The plan with the chunk's front-end prediction as its segment's length (learned predictor only)."""
        if meta is None or meta.predicted is None or not self.mars_config.front_end or meta.segment >= len(plan):
            return plan
        planned = plan[meta.segment]
        return plan[:meta.segment] + (replace(planned, output_tokens=meta.predicted),) + plan[meta.segment + 1:]

    # --- calls ------------------------------------------------------------------------

    def _handle_stopped_request(self, request: Request) -> bool:
        finished = super()._handle_stopped_request(request)
        tracked = self._tracked.get(request.request_id)
        if tracked is not None and not finished and request.status == _PAUSED:
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
        load = self._load()
        progress.api_started_s = load.now_s
        tracked.in_call = True
        before = len(progress.assignments)
        if tracked.override is not None:
            strategy = tracked.override
        else:
            strategy = self.mars_policy.strategy_at_call(progress, load) or Strategy.PRESERVE
        if not apply:
            strategy = Strategy.PRESERVE
        if strategy is Strategy.SWAP and not self._can_swap(request, load):
            strategy = self.mars_policy.host_full_fallback(progress, load)  # no room (or no connector)
        self._emit_assignments(tracked, before)
        tracked.strategies.append(strategy.value)
        self._emit("api_start", tracked, segment=progress.segment_index, strategy=strategy.value,
                   context_tokens=request.num_computed_tokens,
                   duration_s=progress.predictions[progress.segment_index].api_duration_s)
        if apply:
            self._apply(request, tracked, strategy)

    def _can_swap(self, request: Request, load: EngineLoad) -> bool:
        return (self._swapper is not None and len(self.kv_cache_manager.get_block_ids(request.request_id)) == 1
                and load.host_free_tokens >= request.num_computed_tokens)

    def _apply(self, request: Request, tracked: Tracked, strategy: Strategy) -> None:
        rid = request.request_id
        if strategy is Strategy.PRESERVE:
            tracked.kv = Kv.DEVICE
            if self.mars_policy.reconsiders_paused:
                self._paused_preserved[rid] = request
        elif strategy is Strategy.DISCARD:
            # num_computed_tokens stays: _update_request_as_session rebuilds the prompt with it.
            self._free_request_blocks(request)
            tracked.kv = Kv.DISCARDED
        else:
            block_ids = self.kv_cache_manager.get_block_ids(rid)[0]
            tracked.saved_tokens = request.num_computed_tokens
            self._swapper.queue_swap_out(rid, block_ids, tracked.saved_tokens)
            tracked.kv = Kv.SWAP_QUEUED

    def _reconsider_paused(self) -> None:
        if not self._paused_preserved:
            return
        load = self._load()
        for rid, request in list(self._paused_preserved.items()):
            tracked = self._tracked.get(rid)
            if tracked is None or request.status != _PAUSED or tracked.kv != Kv.DEVICE:
                del self._paused_preserved[rid]
                continue
            try:
                before = len(tracked.progress.assignments)
                strategy = self.mars_policy.reconsider(tracked.progress, load)
                if strategy is None:
                    continue
                del self._paused_preserved[rid]
                if strategy is Strategy.SWAP and not self._can_swap(request, load):
                    strategy = self.mars_policy.host_full_fallback(tracked.progress, load)
                self._emit_assignments(tracked, before)
                tracked.strategies[-1] = strategy.value
                self._apply(request, tracked, strategy)
            except Exception as error:  # noqa: BLE001
                self._paused_preserved.pop(rid, None)
                self._fail(request, error, "reconsidering a paused request")

    def _update_request_as_session(self, session: Request, update: Any) -> None:
        tracked = self._tracked.get(session.request_id)
        if tracked is None or session.request_id in self._failed:
            return super()._update_request_as_session(session, update)
        was_paused = session.status == _PAUSED
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
        self._paused_preserved.pop(rid, None)

    def _after_resume(self, session: Request, tracked: Tracked, update: Any, was_paused: bool, now: float) -> None:
        rid = session.request_id
        progress = tracked.progress
        call = progress.segment.api
        returned = max(len(update.prompt_token_ids or ()) - 1, 0)  # chunk = [last token] + return
        duration = now - (progress.api_started_s or now)
        if call is not None and was_paused:
            self.mars_policy.predictor.observe(ApiCall(call.api_type, duration, returned))
        self._emit("api_end", tracked, segment=progress.segment_index, return_tokens=returned)
        tracked.in_call = False
        tracked.paused_t = None
        progress.api_started_s = None
        progress.segment_index += 1
        self._extend_plan(tracked, session)
        self._sync(tracked, session)
        if self.mars_policy.requeues_at_tail:
            progress.order_s = now
        self._start_segment(tracked)
        tracked.wait_since_t = now

        where = "device"
        if tracked.kv in (Kv.DISCARDED, Kv.HOST):
            where = "waiting" if tracked.kv == Kv.DISCARDED else "host"
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
        # Kv.SWAP_OUT (async scheduling only): the copy is in flight; update_from_output
        # keeps the blocks and drops the copy.
        self._emit("resume", tracked, segment=progress.segment_index, where=where)

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

    # --- the step ---------------------------------------------------------------------

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        self._end_failed()
        self._iteration += 1
        now = time.monotonic()
        try:
            self._keeper.expire(now)
            self._arm_expiry(now)
            self._make_room_for_head()
        except Exception:  # noqa: BLE001 - kept conversations are an optimisation; the step goes on
            logger.exception("marsched: ending kept conversations failed")
        if self._last_step_t is not None and self.running:
            self._tau = 0.8 * self._tau + 0.2 * min(now - self._last_step_t, 10.0)
        self._last_step_t = now
        self._running_kv = None
        self._outlooks.clear()
        self._sync_active()
        self._reconsider_paused()
        for progress in self.waiting.promote_starving(self._iteration):
            self._promotions += 1
            tracked = self._tracked.get(progress.request_id)
            self._emit("promote", tracked, counter=progress.counter, **self._moving_threshold())
        refreshed = self.waiting.refresh(self._load(), self._iteration)
        self._order_running(refreshed)
        before = {r.request_id for r in self.running}
        self.waiting.gating = True
        try:
            output = super().schedule(*args, **kwargs)
        finally:
            self.waiting.gating = False
        self._after_schedule(output, before)
        return output

    def _sync_active(self) -> None:
        """Bring the policy's view of every request vLLM may have changed up to date.

        Only requests outside the ranked queue change between steps: running ones decode,
        block holders (paused calls, KV loads) can be edited by vLLM's KV handling. A request
        in the ranked queue is synced when it is pushed (`_progress_of`) and vLLM does not
        touch it until it pops it (a request it skips is popped and pushed back), so
        re-reading the thousands that wait would cost O(waiting) per step for nothing.
        """
        tracked = self._tracked
        for queue in (self.running, self.kv_holding_waiting):
            for request in queue:
                found = tracked.get(request.request_id)
                if found is not None:
                    self._sync(found, request)

    def _internal_id(self, rid: str) -> str:
        if rid in self._tracked:
            return rid
        for internal, tracked in self._tracked.items():
            if tracked.rid == rid:
                return internal
        return rid

    def _order_running(self, refreshed: bool) -> None:
        """Sort `running` so that vLLM's victim (`running[-1]`) is the policy's victim."""
        if not self.running:
            return
        load = self._load()
        for request in self.running:
            tracked = self._tracked.get(request.request_id)
            if tracked is not None and (refreshed or self.mars_policy.keys_follow_load is False):
                try:
                    tracked.victim_key = self.mars_policy.victim_key(tracked.progress, load)
                except Exception as error:  # noqa: BLE001
                    tracked.victim_key = math.inf
                    self._fail(request, error, "ranking a running request")
        it = self._iteration

        def key(request: Request) -> tuple[int, float]:
            tracked = self._tracked.get(request.request_id)
            if tracked is None:
                return (1, math.inf)
            try:
                protected = self.mars_policy.is_protected(tracked.progress, it)
            except Exception as error:  # noqa: BLE001
                self._fail(request, error, "ranking a running request")
                return (1, math.inf)
            return (0 if protected else 1, tracked.victim_key)

        self.running.sort(key=key)

    def _after_schedule(self, output: Any, before: set[str]) -> None:
        now = time.monotonic()
        load = None
        popped, self.waiting.popped = self.waiting.popped, set()
        for request in self.running:
            rid = request.request_id
            if rid in before:
                continue
            if rid in self._keeper.claims:  # a follow-up: what it did not compute came from the kept turn
                self._keeper.scheduled(rid, request.num_computed_tokens - output.num_scheduled_tokens.get(rid, 0))
            tracked = self._tracked.get(rid)
            if tracked is None:
                continue
            progress = tracked.progress
            progress.ran_before = True
            if tracked.restore_skip_prefix is not None:
                request.skip_reading_prefix_cache = tracked.restore_skip_prefix
                tracked.restore_skip_prefix = None
            tracked.kv = Kv.DEVICE
            try:
                if progress.promoted or progress.elder:
                    self.mars_policy.protect(progress, self._iteration)
                load = load or self._load()
                tracked.victim_key = self.mars_policy.victim_key(progress, load)
            except Exception as error:  # noqa: BLE001
                self._fail(request, error, "admission")
            if rid not in popped:
                continue  # a preserved request resuming (vLLM's kv_holding_waiting): it held its KV, not queued
            prediction = progress.predictions[progress.segment_index]
            self._emit("admit", tracked, prefill_tokens=output.num_scheduled_tokens.get(rid, 0),
                       wait_s=now - tracked.wait_since_t, score=progress.left_key, promoted=progress.left_promoted,
                       counter=progress.counter,
                       key_basis=key_basis(progress) if self.mars_trace.enabled else None,
                       predicted_output_tokens=prediction.output_tokens,
                       predicted_api_s=prediction.api_duration_s)
        meta = getattr(output, "kv_connector_metadata", None)
        if isinstance(meta, SwapMeta):
            self._swapper.snapshot_dirty = False
            changed, self._changed = self._changed, set()
            requests = {}
            for rid in changed:
                tracked = self._tracked.get(rid)
                info = self._info(tracked) if tracked else self._done.get(rid)
                if info is not None:
                    requests[info["request_id"]] = info
            meta.snapshot = {"state": self.mars_snapshot(), "requests": requests}
            for rid, ids in meta.swap_out:
                if rid.startswith(HOST_KEY_PREFIX):
                    self._keeper.copy_sent(rid, output)
                    continue
                tracked = self._tracked.get(rid)
                if tracked is not None:
                    tracked.kv = Kv.SWAP_OUT
                    self._swap_inflight[rid] = (output, len(ids))
            for rid, ids, _, _ in meta.swap_in:
                self._emit("swap_in", self._tracked.get(rid), blocks=len(ids))
        tokens = output.total_num_scheduled_tokens
        if self.mars_trace.enabled and tokens:
            pool = self.kv_cache_manager.block_pool
            self._emit("schedule", None, iterations=1, batch=len(output.num_scheduled_tokens), tokens=tokens,
                       free_blocks=pool.get_num_free_blocks(), waiting=len(self.waiting),
                       next_score=self.waiting.head_key(), **self._moving_threshold())

    def _moving_threshold(self) -> dict[str, float]:
        """The promotion threshold this step used, for the trace, when it moves with the FCFS wait."""
        return {"threshold": self.waiting.threshold} if self.mars_policy.starvation.moves else {}

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        result = super().update_from_output(scheduler_output, model_runner_output)
        if self._keeper.copies_done(scheduler_output) and self._swapper is not None:
            self._swapper.snapshot_dirty = True  # one more step publishes the state without those blocks
        for rid, (output, blocks) in list(self._swap_inflight.items()):
            if output is not scheduler_output:
                continue
            del self._swap_inflight[rid]
            request = self.requests.get(rid)
            tracked = self._tracked.get(rid)
            if request is None or tracked is None:
                continue
            if request.status == _PAUSED and tracked.kv == Kv.SWAP_OUT:
                self._free_request_blocks(request)  # the copy is done: blocks back to the pool
                tracked.kv = Kv.HOST
                self._emit("swap_out", tracked, blocks=blocks)
            else:  # resumed while the copy ran (async scheduling): keep the blocks, drop the copy
                self._swapper.drop(rid)
                tracked.kv = Kv.DEVICE
        for rid, tokens in scheduler_output.num_scheduled_tokens.items():
            self.waiting.queue.served(rid, tokens)
        now = None
        for outputs in (result or {}).values():
            for out in outputs.outputs:
                tracked = self._tracked.get(out.request_id)
                if tracked is not None and out.new_token_ids and math.isnan(tracked.first_token_t):
                    now = now or time.monotonic()
                    tracked.first_token_t = now
        if self._error_outputs:
            result = self._tell_errors(result if result is not None else {})
        return result

    # --- faults -------------------------------------------------------------------------

    def _fail(self, request: Request, error: BaseException, where: str) -> None:
        """A fault of ours while handling one request: it ends with an error at the next step."""
        rid = request.request_id
        if rid not in self._failed:
            if isinstance(error, MetadataError):
                logger.error("marsched: request %s: %s: %s; ending it with an error", rid, where, error)
            else:
                logger.error("marsched: %s failed for request %s; ending it with an error (the engine goes on)",
                             where, rid, exc_info=error)
        self._failed[rid] = request

    def _end_failed(self) -> None:
        """Finish every request that faulted (FINISHED_ERROR frees its blocks and host copy)."""
        if not self._failed:
            return
        failed, self._failed = self._failed, {}
        for rid, request in failed.items():
            if request.is_finished():  # it ended on its own since (its client has its answer)
                continue
            if self.requests.get(rid) is request:
                self.finish_requests(rid, RequestStatus.FINISHED_ERROR)
            else:  # it never got past arrival: vLLM does not hold it
                self._forget(request)
            self._error_outputs.append(request)

    def _forget(self, request: Request) -> None:
        rid = request.request_id
        self.waiting.remove_requests([request])
        self.kv_holding_waiting.remove_requests([request])
        self._tracked.pop(rid, None)
        self._keeper.forget(rid)
        self._paused_preserved.pop(rid, None)
        self._swap_inflight.pop(rid, None)
        if self._swapper is not None:
            self._swapper.drop(rid)

    def _tell_errors(self, result: dict[int, Any]) -> dict[int, Any]:
        """Answer each request ended for a fault with an error output, as vLLM does for its own."""
        ended, self._error_outputs = self._error_outputs, []
        for request in ended:
            output = EngineCoreOutput(request_id=request.request_id, new_token_ids=[],
                                      finish_reason=FinishReason.ERROR)
            outputs = result.get(request.client_index)
            if outputs is None:
                outputs = result[request.client_index] = EngineCoreOutputs(outputs=[])
            outputs.outputs.append(output)
            if self.finished_req_ids_dict is not None:
                outputs.finished_requests = (outputs.finished_requests or set()) | {request.request_id}
        return result

    def _preempt_request(self, request: Request, timestamp: float, drop_stale_output: bool = False) -> None:
        tracked = self._tracked.get(request.request_id)
        if tracked is not None:
            try:
                blocks = sum(len(ids) for ids in self.kv_cache_manager.get_block_ids(request.request_id))
                tracked.preemptions += 1
                tracked.wait_since_t = time.monotonic()
                strategy = tracked.progress.strategy
                self._emit("preempt", tracked, segment=tracked.progress.segment_index,
                           strategy=strategy.value if strategy else None, freed_blocks=blocks)
            except Exception as error:  # noqa: BLE001
                self._fail(request, error, "preemption")
        super()._preempt_request(request, timestamp, drop_stale_output)

    def has_requests(self) -> bool:
        return (super().has_requests() or bool(self._swap_inflight or self._failed or self._error_outputs)
                or self._keeper.due(time.monotonic()))

    # --- conversations ----------------------------------------------------------------

    def finish_requests(self, request_ids: Any, finished_status: RequestStatus) -> list[Request]:
        """vLLM's abort path, also carrying releases: `marsched-release:<conversation>` ends that
        conversation's retention (a front end whose client went away, or a last turn)."""
        if request_ids is not None:
            ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
            releases = [rid for rid in ids if rid.startswith(RELEASE_PREFIX)]
            for rid in releases:
                self._keeper.release(rid[len(RELEASE_PREFIX):])
            if releases:
                request_ids = [rid for rid in ids if not rid.startswith(RELEASE_PREFIX)]
        return super().finish_requests(request_ids, finished_status)

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

    def _make_room_for_head(self) -> None:
        """Kept conversations give way when the head of the queue does not fit (oldest first)."""
        if not self._keeper.kept or not len(self.waiting):
            return
        head = self.waiting.head_request()
        if head is None:
            return
        block_size = self.cache_config.block_size
        needed = -(-(head.num_tokens - head.num_computed_tokens + 1) // block_size)
        self._keeper.relieve(self.kv_cache_manager.block_pool.get_num_free_blocks(), needed)

    # --- the end ----------------------------------------------------------------------

    def _free_request(self, request: Request, delay_free_blocks: bool = False) -> Any:
        rid = request.request_id
        tracked = self._tracked.get(rid)
        if (tracked is not None and tracked.conversation is not None and tracked.retain
                and request.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)):
            try:
                self._keep_conversation(request, tracked)
            except Exception:  # noqa: BLE001 - nothing is kept; vLLM frees the request as usual
                logger.exception("marsched: keeping the KV of conversation turn %s failed", rid)
        result = super()._free_request(request, delay_free_blocks)
        if tracked is not None:
            try:
                self._forget_finished(request, tracked)
            except Exception:  # noqa: BLE001 - bookkeeping only; vLLM has freed the request
                logger.exception("marsched: bookkeeping for finished request %s failed", rid)
                self._tracked.pop(rid, None)
        return result

    def _forget_finished(self, request: Request, tracked: Tracked) -> None:
        rid = request.request_id
        self.waiting.queue.finished(rid)
        self._keeper.forget(rid)
        self._paused_preserved.pop(rid, None)
        self._swap_inflight.pop(rid, None)
        if self._swapper is not None:
            self._swapper.drop(rid)
        now = time.monotonic()
        if request.status == RequestStatus.FINISHED_ERROR:
            status = "error"
        elif request.status == RequestStatus.FINISHED_ABORTED and not tracked.closing:
            status = "aborted"
        else:
            status = "finished"
        info = self._info(tracked)
        info.update(finished=True, status=status, e2e_s=now - tracked.arrival_t)
        self._done[tracked.rid] = info
        while len(self._done) > _DONE_KEPT:
            self._done.popitem(last=False)
        del self._tracked[rid]
        self._emit("finish", tracked, e2e_s=now - tracked.arrival_t,
                   ttft_s=tracked.first_token_t - tracked.arrival_t, status=status,
                   strategies=list(tracked.strategies), preemptions=tracked.preemptions)

    def shutdown(self) -> None:
        self._keeper.close()
        try:
            super().shutdown()
        finally:
            try:
                self._emit("end", None, requests=len(self._done))
            except Exception:  # noqa: BLE001 - vLLM's state may be gone at shutdown; the trace just ends
                logger.exception("marsched: writing the trace's end event failed")
            self.mars_trace.close()

    # --- inspection (MarsWorkerExtension, tests) --------------------------------------

    def _info(self, tracked: Tracked) -> dict[str, Any]:
        segments = []
        for index in range(tracked.progress.segment_index + 1):
            prediction = tracked.predictions.get(index)
            assignments = [a for a in tracked.progress.assignments if a.segment_index == index]
            last = assignments[-1] if assignments else None
            segments.append({
                "index": index,
                "predicted_output_tokens": prediction.output_tokens if prediction else None,
                "predicted_api_s": prediction.api_duration_s if prediction else None,
                "predicted_return_tokens": prediction.api_return_tokens if prediction else None,
                "strategy": tracked.strategies[index] if index < len(tracked.strategies) else
                (last.strategy.value if last else None),
                "assigned_s": assignments[0].assigned_s if assignments else None,
                "reason": last.reason if last else None,
                "assignments": [(a.strategy.value, a.assigned_s, a.reason) for a in assignments],
            })
        return {"request_id": tracked.rid, "segments": segments, "preemptions": tracked.preemptions,
                "arrival_t": tracked.arrival_t, "first_token_t": tracked.first_token_t, "kv": tracked.kv,
                "finished": False}

    def mars_snapshot(self, request_id: str | None = None) -> dict[str, Any]:
        pool = self.kv_cache_manager.block_pool
        state: dict[str, Any] = {
            "iteration": self._iteration,
            "device_total_blocks": pool.num_gpu_blocks - 1,  # the null block is never free
            "device_free_blocks": pool.get_num_free_blocks(),
            "device_usage": self.kv_cache_manager.usage,
            "host_tokens": self._swapper.host_tokens_used if self._swapper else 0,
            "running": len(self.running),
            "waiting": len(self.waiting),
            "paused": self.num_waiting_for_streaming_input,
            "tracked": len(self._tracked),
            "policy": self.mars_policy.name,
            "retention": self._retention.name,
            "promotions": self._promotions,
            **self._paused_by_strategy(),
            **self._keeper.snapshot(),
        }
        if request_id is not None:
            found = self._done.get(request_id)
            if found is None:
                internal = self._internal_id(request_id)
                tracked = self._tracked.get(internal)
                found = self._info(tracked) if tracked else None
                if tracked is not None:
                    found["blocks"] = sum(len(i) for i in self.kv_cache_manager.get_block_ids(internal))
            state["request"] = found
        return state

    def _paused_by_strategy(self) -> dict[str, int]:
        counts = {f"paused_{s.value}": 0 for s in Strategy}
        for tracked in self._tracked.values():
            if tracked.in_call and tracked.strategies:
                counts[f"paused_{tracked.strategies[-1]}"] += 1
        return counts


class MarsScheduler(MarsSchedulerMixin, AsyncScheduler):
    """The scheduler to load with `scheduler_cls` / `--scheduler-cls`."""

"""`MarsScheduler`: vLLM's V1 scheduler taking its decisions from `marsched.policy`.

Load it with `scheduler_cls="marsched.vllm.MarsScheduler"` (`--scheduler-cls` on
`vllm serve`); choose the policy with `additional_config={"marsched": {...}}`
(`marsched.vllm.config.MarsConfig`).

The call lifecycle runs through the driver both engines share (`marsched.lifecycle`); this
module holds vLLM's hooks and the state the policy reads. Where the policy is plugged in
(vLLM 0.32; every private name used is listed in `marsched.vllm.private_names`):

- waiting order: `self.waiting` is a `RankedRequestQueue` over the policy's
  `WaitingQueue` (keys, refresh every k iterations, starvation promotion);
- preemption victim: vLLM preempts `self.running[-1]`; `running` is a `RunningOrder`, whose
  last element is the lifecycle's victim (`running_order.py`);
- each call's strategy: `call_steps.py`;
- between a conversation's turns: `conversation_steps.py` and `retention.py`;
- faults: `faults.py` (a fault of ours while handling one request ends that request);
- inspection: `snapshot.py`.

`MarsScheduler` puts the logic on vLLM's `AsyncScheduler`, which also runs correctly with
synchronous execution (on CPU vLLM forces that), so one class serves both.
"""

from __future__ import annotations

import math
import time
import weakref
from collections import OrderedDict
from typing import Any

from vllm.logger import init_logger
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.request import Request, RequestStatus, StreamingUpdate

from marsched.lifecycle import CallLifecycle, IterationTime
from marsched.policy import Admission, EngineLoad, KvOutlook, RequestProgress
from marsched.policy.learned_cost import LearnedCost
from marsched.policy.retention import GapEstimator
from marsched.vllm.call_steps import CallSteps
from marsched.vllm.config import MarsConfig
from marsched.vllm.conversation_steps import ENDED, ConversationSteps
from marsched.vllm.faults import FaultIsolation
from marsched.vllm.follow_ups import FollowUps
from marsched.vllm.kv_swap import HostSwapConnector, SwapCopyStats, SwapMeta
from marsched.vllm.ranked_queue import RankedRequestQueue
from marsched.vllm.retention import HOST_KEY_PREFIX, ConversationKeeper
from marsched.vllm.programs import ProgramLedger
from marsched.vllm.running_order import RunningOrder
from marsched.vllm.signals import engine_input_queue, wake_engine_on_shutdown_signals
from marsched.vllm.snapshot import Inspection
from marsched.vllm.step_clock import StepClock, step_shape
from marsched.vllm.told_predictions import ToldPredictions
from marsched.vllm.tool_hints import ConversationTools
from marsched.vllm.trace import open_trace
from marsched.vllm.tracked import Kv, Tracked

logger = init_logger(__name__)

_LIVE: list[weakref.ref] = []  # schedulers of this process, for MarsWorkerExtension
_DONE_KEPT = 10_000  # finished requests whose info stays readable


def live_schedulers() -> list["MarsSchedulerMixin"]:
    return [s for s in (ref() for ref in _LIVE) if s is not None]


class MarsSchedulerMixin(CallSteps, ConversationSteps, FaultIsolation, Inspection):
    """The MARS logic; mix in before a vLLM `Scheduler` class."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # vLLM's shutdown relies on its SIGTERM handler running; see signals.py.
        input_queue = self._input_queue = engine_input_queue()
        if input_queue is not None:
            wake_engine_on_shutdown_signals(input_queue)
        self.mars_config = MarsConfig.from_vllm_config(self.vllm_config)
        self.mars_policy = self.mars_config.build_policy(token_budget=self.max_num_scheduled_tokens)
        self.mars_trace = open_trace(self.mars_config.trace_path, self.vllm_config.parallel_config.data_parallel_index)
        self._iteration = 0
        self.tau = IterationTime(self.mars_policy.cost)
        # The cost model, learned from this engine's steps where no profile or constants were given
        # (each data-parallel rank has its own scheduler, so learns its own).
        self.mars_cost = LearnedCost(self.mars_policy.cost, *self.mars_config.cost_sources(),
                                     learn=self.mars_config.learn_cost)
        self._step_clock = StepClock()
        self._schedule_t = 0.0
        self._running_kv: int | None = None
        # The device's KV capacity (the null block is never free): the Boost order's size is in device seconds.
        self._kv_capacity_tokens = (self.kv_cache_manager.block_pool.num_gpu_blocks - 1) * self.cache_config.block_size
        self._outlooks: dict[str, KvOutlook] = {}  # admission's view of requests, this step (`_outlook`)
        self._tracked: dict[str, Tracked] = {}
        self._in_call: dict[str, Tracked] = {}  # requests inside a call
        self._done: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._swap_inflight: dict[str, tuple[Any, int]] = {}
        self._changed: set[str] = set()  # requests whose info changed since the last publication
        self._published_t = -math.inf
        self._memory_time = (-math.inf, 0, 0.0)  # (next due, requests tracked, value): `_memory_time_in_flight`
        self._failed: dict[str, Request] = {}  # a fault of ours: ended with an error at the next step
        self._error_outputs: list[Request] = []  # ended with an error: told to the client at this step's output
        assert not self.waiting, "the waiting queue is replaced before any request arrives"
        self.waiting = RankedRequestQueue(self.mars_policy, self._progress_of, self._load, lambda: self._iteration,
                                          time.monotonic, self._admits, on_fault=self._fail)
        self._swapper = self.connector if isinstance(self.connector, HostSwapConnector) else None
        if self._swapper is not None:  # one step at the start publishes the state: /marsched/state before any request
            self._swapper.snapshot_dirty = True
        self._retention = self.mars_config.retention_rule()
        self._keeper = ConversationKeeper(self.kv_cache_manager.block_pool, self.cache_config.block_size, self._swapper)
        self._let_kept_give_way()
        self._gaps = GapEstimator()
        self._tools = ConversationTools()  # which tools each conversation's gaps follow
        self._programs = ProgramLedger(rest=self.mars_config.rest_rule(),
                                       program_arrival=self.mars_policy.ranks_by_program_arrival)
        # Conversations recognised from the prompt (`follow_ups.py`): vLLM hashes blocks with prefix caching on.
        self._follow_ups = (FollowUps() if self.mars_config.infer_conversations and self.cache_config.enable_prefix_caching
                            else None)
        self._told = ToldPredictions()  # length predictions the API server sends after their requests
        self.lifecycle = CallLifecycle(self.mars_policy, self.waiting, self, self.mars_trace,
                                       handle_of=self._tracked.get, on_event=self._on_event,
                                       on_fault=self._fail_tracked)
        if not self.cache_config.enable_prefix_caching:
            logger.warning("marsched: prefix caching is off, so a conversation's Preserve retention keeps nothing "
                           "(its follow-up could not find the blocks); Swap retention still works")
        _LIVE.append(weakref.ref(self))
        block_tokens = self.cache_config.block_size
        self.lifecycle.run_started("vllm", self.kv_cache_manager.block_pool.num_gpu_blocks - 1,
                                   self.mars_config.host_swap_tokens // block_tokens if self._swapper else 0,
                                   block_tokens)

    # --- state the policy reads -------------------------------------------------------

    def _load(self) -> EngineLoad:
        if self._running_kv is None:
            self._running_kv = sum(r.num_computed_tokens for r in self.running)
        return EngineLoad(time.monotonic(), self._running_kv, self.tau.seconds, self._host_free_tokens(),
                          self._kv_capacity_tokens)

    def _host_free_tokens(self) -> int:
        if self._swapper is None:
            return 0
        return max(self.mars_config.host_swap_tokens - self._swapper.host_tokens_used, 0)

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
        capacity_tokens = self._kv_capacity_tokens
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
        # A follow-up that has not been scheduled yet has computed nothing (vLLM counts its prefix
        # hit at scheduling), but the KV its conversation kept is held for it: it is priced, and
        # brings work, as the rest of its prompt, as the simulator prices a resumed request.
        reusable = self._keeper.reusable(request.request_id)
        if reusable > tracked.progress.computed_tokens:
            tracked.progress.computed_tokens = reusable
        return tracked.progress

    @staticmethod
    def _sync(tracked: Tracked, request: Request) -> None:
        progress = tracked.progress
        progress.context_tokens = request.num_tokens
        progress.computed_tokens = request.num_computed_tokens
        progress.generated = request.num_output_tokens

    def _on_event(self, tracked: Tracked) -> None:
        self._mark_changed(tracked)

    # --- vLLM's hooks -------------------------------------------------------------------

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

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        now = self._schedule_t = time.monotonic()
        self._end_failed()
        self._iteration += 1
        try:
            self._tend_kept(now)
        except Exception:  # noqa: BLE001 - kept conversations are an optimisation; the step goes on
            logger.exception("marsched: ending kept conversations failed")
        self._running_kv = None
        self._outlooks.clear()
        self._sync_active()
        self._reconsider_paused()
        self.lifecycle.promote_starving()
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

    def _order_running(self, refreshed: bool) -> None:
        """`running` best-ranked first, as a `RunningOrder` naming the lifecycle's victim."""
        load = self._load()
        for request in self.running:
            tracked = self._tracked.get(request.request_id)
            if tracked is not None and (refreshed or self.mars_policy.keys_follow_load is False):
                try:
                    tracked.victim_key = self.mars_policy.victim_key(tracked.progress, load)
                except Exception as error:  # noqa: BLE001
                    tracked.victim_key = math.inf
                    self._fail(request, error, "ranking a running request")
        protected = {r.request_id for r in self.running if self._is_protected(r)}

        def key(request: Request) -> tuple[int, float]:
            tracked = self._tracked.get(request.request_id)
            if tracked is None:
                return (1, math.inf)
            return (0 if request.request_id in protected else 1, tracked.victim_key)

        self.running = RunningOrder(sorted(self.running, key=key), lambda r: r.request_id in protected,
                                    self._victim_key)

    def _is_protected(self, request: Request) -> bool:
        tracked = self._tracked.get(request.request_id)
        if tracked is None:
            return False
        try:
            return self.mars_policy.is_protected(tracked.progress, self._iteration)
        except Exception as error:  # noqa: BLE001
            self._fail(request, error, "ranking a running request")
            return False

    def _victim_key(self, request: Request) -> float:
        tracked = self._tracked.get(request.request_id)
        return math.inf if tracked is None else tracked.victim_key

    def _after_schedule(self, output: Any, before: set[str]) -> None:
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
                if rid in popped:  # not a preserved request resuming (vLLM's kv_holding_waiting)
                    self.lifecycle.admitted(tracked, output.num_scheduled_tokens.get(rid, 0))
                load = load or self._load()
                tracked.victim_key = self.mars_policy.victim_key(progress, load)
            except Exception as error:  # noqa: BLE001
                self._fail(request, error, "admission")
        meta = getattr(output, "kv_connector_metadata", None)
        if isinstance(meta, SwapMeta):
            self._publish(meta)
            for rid, ids in meta.swap_out:
                if rid.startswith(HOST_KEY_PREFIX):
                    self._keeper.copy_sent(rid, output)
                    continue
                tracked = self._tracked.get(rid)
                if tracked is not None:
                    tracked.kv = Kv.SWAP_OUT
                    self._swap_inflight[rid] = (output, len(ids))
            for rid, ids, _, _ in meta.swap_in:
                tracked = self._tracked.get(rid)
                if tracked is not None:
                    self.lifecycle.swapped_in(tracked, len(ids))
        self._step_ran(output)

    def _step_ran(self, output: Any) -> None:
        """τ learns the cost model's time for the step just scheduled, as in the simulator, and the
        trace tells it."""
        shape = step_shape(output, self.requests)
        if shape is None:
            return
        # Autellix's attained service: one per step it runs in, as the simulator counts.
        for rid in output.num_scheduled_tokens:
            tracked = self._tracked.get(rid)
            if tracked is not None:
                tracked.progress.attained_iterations += 1
        if self.mars_cost.step is not None:
            self._step_clock.scheduled(output, self._schedule_t, shape)
        self.tau.observe(self.mars_policy.cost.iteration_time(shape.tokens, shape.context_tokens, shape.sequences,
                                                              shape.attention_pairs))
        pool = self.kv_cache_manager.block_pool
        self.lifecycle.scheduled(iterations=1, batch=shape.sequences, tokens=shape.tokens,
                                 context_tokens=shape.context_tokens,
                                 free_blocks=pool.get_num_free_blocks(),
                                 host_free_blocks=self._host_free_tokens() // self.cache_config.block_size)

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
            if request.status == RequestStatus.WAITING_FOR_STREAMING_REQ and tracked.kv == Kv.SWAP_OUT:
                self._free_request_blocks(request)  # the copy is done: blocks back to the pool
                tracked.kv = Kv.HOST
                self.lifecycle.swapped_out(tracked, blocks)
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
        if self.mars_cost.learning:
            self._learn_cost(scheduler_output, model_runner_output)
        return result

    def _learn_cost(self, scheduler_output: Any, model_runner_output: Any) -> None:
        """The step's measured time and the copies that landed in it, into the learned cost model;
        the policy decides with the new one from the next step on."""
        try:
            changed = False
            measured = self._step_clock.updated(scheduler_output, time.monotonic())
            if measured is not None:
                changed = self.mars_cost.observe_step(*measured)
            connector_output = getattr(model_runner_output, "kv_connector_output", None)
            copies = getattr(connector_output, "kv_connector_stats", None)
            if isinstance(copies, SwapCopyStats) and copies.blocks:
                changed |= self.mars_cost.observe_copies(copies.blocks, copies.blocks * self.cache_config.block_size,
                                                         copies.seconds)
            if changed:
                self.mars_policy.cost = self.mars_cost.cost
        except Exception:  # noqa: BLE001 - the cost model stays as it was; the engine goes on
            logger.exception("marsched: learning the cost model failed; it stays as it was")
            self.mars_cost.step = self.mars_cost.swap = None

    def _preempt_request(self, request: Request, timestamp: float, drop_stale_output: bool = False) -> None:
        tracked = self._tracked.get(request.request_id)
        blocks = 0
        if tracked is not None:
            try:
                blocks = sum(len(ids) for ids in self.kv_cache_manager.get_block_ids(request.request_id))
            except Exception as error:  # noqa: BLE001
                self._fail(request, error, "preemption")
        requester = getattr(self.running, "requester", None)  # RunningOrder: whom the preemption makes room for
        super()._preempt_request(request, timestamp, drop_stale_output)
        if tracked is not None:
            try:
                self.lifecycle.preempted(tracked, blocks, self._tracked.get(requester.request_id) if requester else None)
            except Exception as error:  # noqa: BLE001
                self._fail(request, error, "preemption")

    def has_requests(self) -> bool:
        return (super().has_requests() or bool(self._swap_inflight or self._failed or self._error_outputs)
                or self._keeper.due(time.monotonic()))

    # --- the end ----------------------------------------------------------------------

    def _free_request(self, request: Request, delay_free_blocks: bool = False) -> Any:
        rid = request.request_id
        tracked = self._tracked.get(rid)
        if self._keeps_turn(request, tracked):
            try:
                self._keep_conversation(request, tracked)
            except Exception:  # noqa: BLE001 - nothing is kept; vLLM frees the request as usual
                logger.exception("marsched: keeping the KV of conversation turn %s failed", rid)
        elif tracked is not None and tracked.inferred and request.status in ENDED:
            try:
                self._inferred_turn_ended(request, tracked)
            except Exception:  # noqa: BLE001 - its follow-up will not be recognised; vLLM frees it as usual
                logger.exception("marsched: remembering inferred conversation turn %s failed", rid)
        result = super()._free_request(request, delay_free_blocks)
        if tracked is not None:
            try:
                self._forget_finished(request, tracked)
            except Exception:  # noqa: BLE001 - bookkeeping only; vLLM has freed the request
                logger.exception("marsched: bookkeeping for finished request %s failed", rid)
                self._tracked.pop(rid, None)
                self._in_call.pop(rid, None)
                self._told.forget(tracked.rid, rid)
        return result

    def _forget_finished(self, request: Request, tracked: Tracked) -> None:
        rid = request.request_id
        if tracked.conversation is not None:
            self._programs.turn_ends(tracked.conversation, tracked.progress, last=not tracked.retain)
        self._told.forget(tracked.rid, rid)
        self.waiting.queue.finished(rid)
        self._keeper.forget(rid)
        self._left_call(tracked)
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
        self.lifecycle.finished(tracked, now - tracked.arrival_t, tracked.first_token_t - tracked.arrival_t, status,
                                request.num_output_tokens)

    def shutdown(self) -> None:
        self._keeper.close()
        try:
            super().shutdown()
        finally:
            try:
                self.lifecycle.ended(len(self._done))
            except Exception:  # noqa: BLE001 - vLLM's state may be gone at shutdown; the trace just ends
                logger.exception("marsched: writing the trace's end event failed")
            self.mars_trace.close()


class MarsScheduler(MarsSchedulerMixin, AsyncScheduler):
    """The scheduler to load with `scheduler_cls` / `--scheduler-cls`."""

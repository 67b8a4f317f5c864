"""`CallLifecycle`: the steps of an augmented request's life that every engine takes alike.

The policy decides (strategy, order, protection); the driver runs each decision through the
same steps in both engines and writes its trace event: a segment starts (`predict`,
`assign_strategy`), the request leaves the queue (`admit`, with protection), it is preempted
(`preempt`), its call starts (`api_start`, with the host-full fallback and the move of its KV),
a preserved call is revisited, the call returns (`api_end`), the next segment resumes
(`resume`), starving requests are promoted (`promote`), and it finishes (`finish`). The
engine-wide events (`run`, `schedule`, `swap_out`, `swap_in`, `end`) are written here too, so
that every event has one definition of its fields.

What stays in an engine: where its blocks are and how they move (`EngineSide`), its clock,
its batch, and when it calls each step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from marsched.metrics.trace import SCHEMA_VERSION, EventTrace, event_fields
from marsched.policy.load import EngineLoad
from marsched.policy.pins import release_order
from marsched.policy.policy import Policy
from marsched.policy.progress import RequestProgress, StrategyAssignment
from marsched.policy.strategy import Strategy
from marsched.policy.trace_fields import declaration, key_basis
from marsched.workload.model import ApiCall


class CallHandle(Protocol):
    """An engine's request as the driver reads and updates it."""

    progress: RequestProgress
    strategies: list[str]  # the strategy each call ran under
    wait_since_s: float  # when it last entered the waiting queue
    max_wait_s: float
    preemptions: int
    override: Strategy | None  # a strategy the request asked for itself (vLLM: `allow_request_strategy`)

    @property
    def rid(self) -> str: ...


class EngineSide(Protocol):
    """What the driver needs of an engine: its clock and load, and its KV moves at a call."""

    def clock(self) -> float: ...

    def current_iteration(self) -> int: ...

    def load(self) -> EngineLoad: ...

    def kv_blocks_in_use(self) -> tuple[int, int]:
        """Device and host KV blocks in use engine-wide (every event carries them)."""

    def can_swap(self, handle: Any) -> bool:
        """Whether the host has room for this request's KV now."""

    def keep(self, handle: Any) -> None:
        """Preserve: the KV stays on the device for the call."""

    def discard(self, handle: Any) -> None:
        """Discard: free the device blocks; the context is recomputed after the call."""

    def swap_out(self, handle: Any) -> None:
        """Swap: start copying the KV to host memory (the blocks are freed when it is done)."""

    def holds_preserved(self, handle: Any) -> bool:
        """Whether a preserved call is still paused with its KV on the device (to revisit it)."""


class QueueView(Protocol):
    """The waiting queue as the driver reads it (`policy.queue.WaitingQueue`, or vLLM's wrapper of it)."""

    def promote_starving(self, iteration: int, now_s: float) -> list[RequestProgress]: ...

    def threshold(self, now_s: float) -> float | None: ...

    def head_key(self) -> float | None: ...

    def __len__(self) -> int: ...


Fault = Callable[[Any, BaseException, str], None]


class CallLifecycle:
    def __init__(self, policy: Policy, queue: QueueView, engine: EngineSide, trace: EventTrace,
                 handle_of: Callable[[str], Any], on_event: Callable[[Any], None] | None = None,
                 on_fault: Fault | None = None) -> None:
        self.policy = policy
        self.queue = queue
        self.engine = engine
        self.trace = trace
        self.handle_of = handle_of  # the engine's request by request id
        self.on_event = on_event  # told of every request's event (the plugin's inspection state)
        self.on_fault = on_fault  # a fault revisiting one request ends it; without: raised
        self.paused_preserved: dict[str, Any] = {}  # preserved calls the policy revisits, by request id
        self.promotions = 0
        self.threshold: float | None = policy.starvation.threshold  # the promotion threshold this step used
        # The run's cost model: an admit's key basis names the one its key used where it differs (a server learns).
        self._declared_cost = policy.cost

    # --- the trace --------------------------------------------------------------------

    def emit(self, event: str, handle: Any | None, t: float | None = None, **fields: Any) -> None:
        """One trace event with the fields every event carries (`metrics/trace.schema.json`)."""
        if handle is not None and self.on_event is not None:
            self.on_event(handle)
        if not self.trace.enabled:
            return
        segment = handle.progress.segment_index if handle is not None else None
        device, host = self.engine.kv_blocks_in_use()
        common = event_fields(event, self.engine.current_iteration(), segment, fields, device, host)
        self.trace.emit(event, self.engine.clock() if t is None else t, handle.rid if handle is not None else None,
                        **common)

    def run_started(self, engine: str, device_blocks: int, host_blocks: int, block_tokens: int) -> None:
        self._declared_cost = self.policy.cost
        self.emit("run", None, schema_version=SCHEMA_VERSION, engine=engine, policy=declaration(self.policy),
                  device_blocks=device_blocks, host_blocks=host_blocks, block_tokens=block_tokens)

    def scheduled(self, *, iterations: int, batch: int, tokens: int, context_tokens: int, free_blocks: int,
                  host_free_blocks: int, dt_s: float | None = None, span_s: float | None = None) -> None:
        """A step ran (`iterations` identical ones in the simulator). `dt_s`/`span_s`: its time, where
        the engine knows it when it schedules (the simulator's cost model; a real engine does not)."""
        if not self.trace.enabled:
            return
        timing = {} if dt_s is None else {"dt_s": dt_s, "span_s": span_s}
        self.emit("schedule", None, iterations=iterations, batch=batch, tokens=tokens,
                  context_tokens=context_tokens, **timing, free_blocks=free_blocks,
                  host_free_blocks=host_free_blocks, waiting=len(self.queue), next_score=self.queue.head_key(),
                  **self.moving_threshold())

    def ended(self, requests: int) -> None:
        self.emit("end", None, requests=requests)

    def moving_threshold(self) -> dict[str, float]:
        """The promotion threshold this step used, for the trace, when it moves with the FCFS wait."""
        return {"threshold": self.threshold} if self.policy.starvation.moves else {}

    def assignments(self, handle: Any, since: int, queue: str) -> None:
        for a in handle.progress.assignments[since:]:
            self.emit("assign_strategy", handle, segment=a.segment_index, queue=queue, strategy=a.strategy.value,
                      reason=a.reason, context_tokens=a.context_tokens, api_s=a.api_s)

    # --- a request's life -------------------------------------------------------------

    def arrived(self, handle: Any, arrival_s: float, prompt_tokens: int, **program: Any) -> None:
        """Taken in at the iteration boundary (`t`); `arrival_s` is when it arrived. The engine
        then starts its first segment (`start_segment`). `program`: the engine's fields naming the
        program the request is a turn of (vLLM: `program`, `identity`), for the trace."""
        progress = handle.progress
        # A turn of a program (marsched.vllm.programs) starts with the wait its program carried, the
        # service its program attained (Autellix's PLAS ranks by it), its program's first arrival as
        # its place (unless the policy requeues at the tail) and its program's promotion for life.
        carried = self.policy.starvation.carried(progress)
        extra = {"carried": carried} if carried else {}
        if progress.attained_iterations:
            extra["attained"] = progress.attained_iterations
        if progress.order_s != arrival_s:
            extra["program_arrival_s"] = progress.order_s
        if progress.elder:
            extra["elder"] = True
        self.emit("arrive", handle, arrival_s=arrival_s, prompt_tokens=prompt_tokens, **program, **extra)

    def start_segment(self, handle: Any, queue: str, source: str = "plan") -> None:
        """A segment becomes current (arrival, call return): predict, and fix the strategy if the
        policy decides ahead (or the request chose its own). `source`: where the plan's length came
        from (`front-end`: the vLLM front end's prediction)."""
        progress = handle.progress
        before = len(progress.assignments)
        load = self.engine.load()
        self.policy.start_segment(progress, load)
        index = progress.segment_index
        prediction = progress.predictions[index]
        if handle.override is not None and progress.segment.api is not None:
            progress.assign(StrategyAssignment(index, handle.override, load.now_s,
                                               progress.context_tokens + prediction.output_tokens,
                                               prediction.api_duration_s, "request"))
        self.emit("predict", handle, segment=index, queue=queue, output_tokens=prediction.output_tokens,
                  api_s=prediction.api_duration_s, return_tokens=prediction.api_return_tokens,
                  predictor=self.policy.predictor.length.name, source=source)
        self.assignments(handle, before, queue)

    def admitted(self, handle: Any, prefill_tokens: int) -> None:
        """It leaves the waiting queue for the device (prefill, or a swap-in): a promoted or elder
        request is protected from preemption from here. The event states the protection it
        leaves the request with, for the audit."""
        now = self.engine.clock()
        wait = now - handle.wait_since_s
        handle.max_wait_s = max(handle.max_wait_s, wait)
        progress = handle.progress
        progress.ran_before = True
        self.policy.observe_admission(progress, wait)
        iteration = self.engine.current_iteration()
        if progress.promoted or progress.elder:
            self.policy.protect(progress, iteration)
        if self.trace.enabled:  # the key basis is built only for a trace
            prediction = progress.predictions[progress.segment_index]
            self.emit("admit", handle, prefill_tokens=prefill_tokens, wait_s=wait, score=progress.left_key,
                      promoted=progress.left_promoted, counter=progress.counter,
                      key_basis=key_basis(progress, self._declared_cost),
                      predicted_output_tokens=prediction.output_tokens, predicted_api_s=prediction.api_duration_s,
                      **self._protection(progress, iteration))
        elif self.on_event is not None:
            self.on_event(handle)

    def _protection(self, progress: RequestProgress, iteration: int) -> dict[str, int | None]:
        """What protects the request from preemption now: the first iteration it may be preempted
        again, or the segment it may not be preempted in (None: nothing)."""
        if not self.policy.starvation.enabled:
            return {}
        until = progress.protected_until_iteration
        segment = progress.protected_segment
        return {"protected_until": until if until > iteration else None,
                "protected_segment": segment if segment == progress.segment_index else None}

    def preempted(self, handle: Any, freed_blocks: int, requester: Any | None = None) -> None:
        """It loses its device blocks and waits again; it keeps its strategy and its counter.
        `requester`: the request it made room for, where the engine knows it."""
        handle.preemptions += 1
        handle.wait_since_s = self.engine.clock()
        strategy = handle.progress.strategy
        made_room_for = {} if requester is None else {"requester": requester.rid}
        self.emit("preempt", handle, strategy=strategy.value if strategy else None, freed_blocks=freed_blocks,
                  **made_room_for)

    def promote_starving(self) -> None:
        """Starvation prevention: requests whose counter reached the threshold go ahead of the ranking."""
        now = self.engine.clock()
        if self.trace.enabled and self.policy.starvation.moves:
            self.threshold = self.queue.threshold(now)
        for progress in self.queue.promote_starving(self.engine.current_iteration(), now):
            self.promotions += 1
            self.emit("promote", self.handle_of(progress.request_id), counter=progress.counter,
                      **self.moving_threshold())

    # --- calls ------------------------------------------------------------------------

    def start_call(self, handle: Any, context_tokens: int, duration_s: float, apply: bool = True) -> Strategy:
        """The segment's call starts: the strategy in force (fixed ahead, or chosen now; the
        request's own if it asked), Swap falling back when the host has no room, then the KV move.
        `apply=False`: the call's answer is already here, so the KV stays. `duration_s`: the call's
        time as the engine knows it now (the workload's in the simulator, the prediction in vLLM)."""
        progress = handle.progress
        progress.api_started_s = self.engine.clock()
        before = len(progress.assignments)
        if handle.override is not None:
            strategy = handle.override
        else:  # None: a call the plan did not have (vLLM); its KV stays
            strategy = self.policy.strategy_at_call(progress, self.engine.load()) or Strategy.PRESERVE
        if not apply:
            strategy = Strategy.PRESERVE
        handle.strategies.append(strategy.value)
        strategy = self._move(handle, strategy, before, apply)
        self.emit("api_start", handle, strategy=strategy.value, context_tokens=context_tokens, duration_s=duration_s)
        return strategy

    def start_trailing_call(self, handle: Any, context_tokens: int, duration_s: float) -> None:
        """The last segment's call: nothing is computed after it, so the engine frees its KV."""
        handle.progress.api_started_s = self.engine.clock()
        self.emit("api_start", handle, strategy=None, context_tokens=context_tokens, duration_s=duration_s)

    def _move(self, handle: Any, strategy: Strategy, assigned_since: int, apply: bool = True) -> Strategy:
        """Run the call's strategy on the engine's KV; Swap without host room falls back. The
        assignments made since `assigned_since` are written first, with the KV still in place."""
        progress = handle.progress
        if strategy is Strategy.SWAP and not self.engine.can_swap(handle):
            strategy = self.policy.host_full_fallback(progress, self.engine.load())
            handle.strategies[-1] = strategy.value
        self.assignments(handle, assigned_since, "paused")
        if not apply:
            return strategy
        if strategy is Strategy.PRESERVE:
            if self.policy.reconsiders_paused:
                self.paused_preserved[progress.request_id] = handle
            self.engine.keep(handle)
        elif strategy is Strategy.DISCARD:
            self.engine.discard(handle)
        else:
            self.engine.swap_out(handle)
        return strategy

    def reconsider_paused(self) -> None:
        """For policies that choose at the call (INFERCEPT): each preserved call is priced again
        with the time it has left, and moves if another strategy became cheaper."""
        if not self.paused_preserved:
            return
        load = self.engine.load()
        for rid, handle in list(self.paused_preserved.items()):
            try:
                if not self.engine.holds_preserved(handle):
                    del self.paused_preserved[rid]
                    continue
                before = len(handle.progress.assignments)
                strategy = self.policy.reconsider(handle.progress, load)
                if strategy is None:
                    continue
                del self.paused_preserved[rid]
                handle.strategies[-1] = strategy.value
                self._move(handle, strategy, before)
            except Exception as error:  # noqa: BLE001 - with a fault handler, only this request ends
                if self.on_fault is None:
                    raise
                self.paused_preserved.pop(rid, None)
                self.on_fault(handle, error, "reconsidering a paused request")

    def release_pinned(self) -> bool:
        """Memory ran short: give up the newest program's preserved call (`policy/pins.py`). False
        when no call is preserved."""
        pinned = [h for h in self.paused_preserved.values() if self.engine.holds_preserved(h)]
        if not pinned:
            return False
        handle = release_order(pinned, lambda h: (h.progress.order_s, h.rid))[0]
        before = len(handle.progress.assignments)
        del self.paused_preserved[handle.rid]
        strategy = self.policy.release_pin(handle.progress, self.engine.load())
        handle.strategies[-1] = strategy.value
        self._move(handle, strategy, before)
        return True

    def call_returned(self, handle: Any, observed: ApiCall | None, return_tokens: int) -> None:
        """The call's answer is here. `observed`: the call as it happened, for the duration
        estimator (None: a call the plan did not have)."""
        if observed is not None:
            self.policy.predictor.observe(observed)
            self.policy.observe_call(observed.api_type.value, observed.duration_s)
        self.paused_preserved.pop(handle.progress.request_id, None)
        self.emit("api_end", handle, return_tokens=return_tokens)

    def begin_next_segment(self, handle: Any) -> None:
        """Past the call: the next segment is current (the engine then sets the context it knows)."""
        progress = handle.progress
        progress.segment_index += 1
        progress.generated = 0
        progress.api_started_s = None
        progress.attained_before_segment = progress.attained_iterations

    def resumed(self, handle: Any, where: str) -> None:
        """The next segment runs from `where` (device, waiting, host). A request that waits again
        enters the queue now (and at its tail for policies that requeue, as stock vLLM); the
        engine pushes it after this."""
        if where != "device":
            now = self.engine.clock()
            if self.policy.requeues_at_tail:
                handle.progress.order_s = now
            handle.wait_since_s = now
        self.emit("resume", handle, where=where)

    def finished(self, handle: Any, e2e_s: float, ttft_s: float, status: str = "finished",
                 last_output_tokens: int | None = None) -> None:
        """It left the engine; `last_output_tokens`: what its last segment generated, where the
        request's segments hold only a plan (vLLM)."""
        self.paused_preserved.pop(handle.progress.request_id, None)
        if status == "finished":
            self.policy.observe_finish(handle.progress, last_output_tokens)
        # How many segments it had is known only now (the arrival does not tell: the knowledge boundary).
        self.emit("finish", handle, e2e_s=e2e_s, ttft_s=ttft_s, status=status, strategies=list(handle.strategies),
                  preemptions=handle.preemptions, segments=handle.progress.segment_index + 1)

    def swapped_out(self, handle: Any, blocks: int, t: float | None = None) -> None:
        self.emit("swap_out", handle, t, blocks=blocks)

    def swapped_in(self, handle: Any, blocks: int, t: float | None = None) -> None:
        self.emit("swap_in", handle, t, blocks=blocks)

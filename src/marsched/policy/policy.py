"""A scheduling policy: an order for the waiting queue and a rule for each call's strategy.

One `Policy` object decides in the simulator and inside vLLM alike; engines ask it and
never decide on their own. The named policies are built in `registry.py`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from enum import Enum

from marsched.policy.admission import Admission, KvOutlook, predicted_peak_tokens
from marsched.policy.compaction import cached_after_call, next_context
from marsched.policy.cost_model import CostModel
from marsched.policy.load import EngineLoad
from marsched.policy.progress import RequestProgress, StrategyAssignment
from marsched.policy.ranking import KeyForm, RankingTerms, SegmentOutlook, remaining_area_form
from marsched.policy.boost import boost_from_excess, boost_key
from marsched.policy.gittins import gittins_outlook
from marsched.policy.plas import plas_key
from marsched.policy.program import rest_area_per_iteration
from marsched.policy.program_rest import ProgramRest, RestRule, call_chance
from marsched.policy.size_labels import SizeLabels
from marsched.policy.strategy import Strategy
from marsched.policy.ttl import FixedTtl, PaperTtl
from marsched.policy.waste import CallCosts, call_wastes, cheapest
from marsched.predict.segment import SegmentPredictor
from marsched.workload.past import RequestPast


_RECOMPUTE_MEMO = 65_536  # token counts `Policy.recompute_time` keeps before it starts again


class Order(str, Enum):
    FCFS = "fcfs"  # by original arrival, kept across calls
    FCFS_REENTRY = "fcfs-reentry"  # by the last time the request entered the queue (stock vLLM)
    MEMORY_TIME = "memory-time"  # MARS: predicted memory × time of the remaining life
    # MARS's key as a size in device seconds, boosted ahead of the arrival order (`boost.py`)
    BOOST = "boost"
    # First come first served by the same arrival, where a small arrival may swap places with a
    # large request among the last M waiting (`nudge.py`); the queue keeps the places
    NUDGE = "nudge"
    REMAINING_TOKENS = "remaining-tokens"  # SJF: predicted tokens still to generate
    LEAST_ATTAINED = "least-attained"  # Autellix's PLAS: the program's attained service, in levels (`plas.py`)


class StrategyRule(str, Enum):
    FIXED = "fixed"  # one strategy for every call
    AHEAD = "ahead"  # min-waste from predictions when the segment starts; kept to the call
    AT_CALL = "at-call"  # min-waste from the actual context and call time, revisited while preserved
    END_AT_CALL = "end-at-call"  # the request leaves at the call and queues again at the tail
    # INFERCEPT's published code: preserve at the call; every iteration discard by chunked-recompute
    # waste and swap targets out within a per-iteration block budget (`infercept_code.py`, simulator only)
    BUDGETED = "budgeted"
    # Continuum: the KV is kept for a time-to-live after the call (`ttl.py`), then freed; pins are
    # released, newest program first, when memory runs short
    TTL = "ttl"


class StarvationClock(str, Enum):
    ITERATIONS = "iterations"  # scheduling iterations spent waiting (the MARS paper and code)
    SECONDS = "seconds"  # engine seconds spent waiting


class StarvationCount(str, Enum):
    ALL_WAITING = "all-waiting"  # every waiting request counts
    REQUEUED = "requeued"  # only requests that ran before (preempted or discarded): the MARS code


class Protection(str, Enum):
    QUANTUM = "quantum"  # not a preemption victim for `quantum` iterations after admission
    SEGMENT = "segment"  # not a preemption victim until its current segment ends


@dataclass(frozen=True, slots=True)
class StarvationConfig:
    """Promote a request that waited `threshold` (in `clock` units); protect it once admitted.

    A promoted request goes ahead of the ranking (in promotion order, or by arrival when the
    promotion is `for_life`) and is protected from preemption (`protection`). Its counter
    survives preemption and calls; it resets at promotion unless the promotion is for life.
    With `fcfs_multiple` (a seconds clock), the threshold is the larger of `threshold` and that
    multiple of the wait first come first served would give a request arriving now
    (`fcfs_wait.FcfsWait`): under overload it grows with the unserved work, so the ranking
    keeps deciding, and no request waits much longer than that multiple of what a new arrival
    would wait under FCFS.
    `threshold=None` turns prevention off. The defaults are the MARS code's benchmark
    script's: 100 iterations, and a quantum of 100,000 iterations (in effect, until the
    request finishes). The named variants are in `registry.py`.
    """

    threshold: float | None = 100  # None: off
    quantum: int = 100_000
    clock: StarvationClock = StarvationClock.ITERATIONS
    counts: StarvationCount = StarvationCount.ALL_WAITING
    protection: Protection = Protection.QUANTUM
    for_life: bool = False  # a promotion lasts for the request's remaining segments, first come first served
    fcfs_multiple: float | None = None  # threshold at least this multiple of the FCFS wait (seconds clock)
    # The threshold is a ratio: waiting of at least `threshold` × the request's attained service
    # (at least 1 iteration) promotes it (Autellix's anti-starvation; an iteration clock).
    per_service: bool = False

    def __post_init__(self) -> None:
        if self.threshold is not None and not (self.threshold > 0 and math.isfinite(self.threshold)):
            raise ValueError(f"starvation threshold must be > 0 or off, got {self.threshold}")
        if self.clock is StarvationClock.ITERATIONS and self.threshold is not None and self.threshold < 1:
            raise ValueError(f"starvation threshold in iterations must be >= 1, got {self.threshold}")
        if self.quantum < 0:
            raise ValueError(f"starvation quantum must be >= 0, got {self.quantum}")
        if self.per_service and self.clock is not StarvationClock.ITERATIONS:
            raise ValueError("a threshold per iteration of service needs the iteration clock")
        if self.fcfs_multiple is not None:
            if not (self.fcfs_multiple > 0 and math.isfinite(self.fcfs_multiple)):
                raise ValueError(f"starvation FCFS-wait multiple must be > 0, got {self.fcfs_multiple}")
            if self.clock is not StarvationClock.SECONDS:
                raise ValueError("a threshold relative to the FCFS wait needs the seconds clock")

    @property
    def enabled(self) -> bool:
        return self.threshold is not None

    @property
    def moves(self) -> bool:
        """Whether the threshold moves with the FCFS wait (the trace then reports it per step)."""
        return self.enabled and self.fcfs_multiple is not None

    def offset(self, progress: RequestProgress) -> float:
        """How much longer than `threshold` this request waits before promotion (per-service rules)."""
        return self.threshold * (max(progress.attained_iterations, 1) - 1) if self.per_service else 0.0

    def carried(self, progress: RequestProgress) -> float:
        """The count this request carries while out of the queue, in this rule's clock."""
        return progress.waited_s if self.clock is StarvationClock.SECONDS else progress.waited_iterations

    def counts_for(self, progress: RequestProgress) -> bool:
        """Whether this request's waiting counts towards promotion."""
        return self.enabled and (self.counts is StarvationCount.ALL_WAITING or progress.ran_before)


@dataclass(slots=True)
class Policy:
    name: str
    order: Order
    rule: StrategyRule
    cost: CostModel
    predictor: SegmentPredictor
    fixed_strategy: Strategy | None = None
    starvation: StarvationConfig = field(default_factory=lambda: StarvationConfig(threshold=None))
    refresh_interval: int = 1  # recompute queue keys every k iterations...
    refresh_tolerance: float = 0.05  # ...when the load they follow moved by more than this fraction
    terms: RankingTerms = field(default_factory=RankingTerms)
    admission: Admission = Admission.GREEDY
    # The engine keeps freed KV blocks' content for a later prefix hit (vLLM V1's automatic prefix
    # caching): a discarded or preempted request recomputes only what was evicted meanwhile.
    prefix_cache: bool = False
    # Host memory is a prefix store (vLLM's CPU offloading): freed prefixes are stored there and a
    # request loads its stored prefix back over the host link before it computes. Needs the cache.
    offload: bool = False
    ttl: PaperTtl | FixedTtl | None = None  # the TTL rule's estimator (StrategyRule.TTL)
    # What the key knows of a request past its current segment (`program_rest.py`): PLAN reads the
    # trace's later segments (a bound); MEAN and GITTINS learn it from the requests that ended.
    rest: RestRule = RestRule.PLAN
    # The plan a request carries is what its client declared (a live server's: over HTTP, one
    # segment of `max_tokens`), not the trace's future: a predictor that learns online still learns
    # from every request that ends, as it does under MEAN and GITTINS.
    plan_is_declared: bool = False
    boost_gamma: float | None = None  # γ of the BOOST order, per second (`boost.py`)
    # What the AT_CALL rule (INFERCEPT) prices a call with: its true duration, as its source does in
    # simulation (a bound), or the predicted one, which is all a server has (the live twin's).
    reads_true_call_time: bool = True
    nudge_m: int | None = None  # the NUDGE order's window: the last M waiting requests (`nudge.py`)
    program_rest: ProgramRest = field(default_factory=ProgramRest, compare=False, repr=False)
    # The BOOST order's prediction-label form (`size_labels.py`): None ranks by the predicted size as if exact.
    size_labels: SizeLabels | None = field(default=None, compare=False, repr=False)
    # Tfwd by token count, for the cost it was computed with: a MARS key asks it for every later
    # call at every push, of the same few contexts.
    _recompute_memo: tuple[CostModel | None, dict[int, float]] = field(
        default_factory=lambda: (None, {}), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.refresh_interval < 1:
            raise ValueError(f"refresh interval must be >= 1 iteration, got {self.refresh_interval}")
        if (self.rule is StrategyRule.FIXED) != (self.fixed_strategy is not None):
            raise ValueError("a fixed strategy goes with the FIXED rule, and only with it")
        if self.offload and not self.prefix_cache:
            raise ValueError("host offloading serves prefix hits: it needs the prefix cache")
        if (self.rule is StrategyRule.TTL) != (self.ttl is not None):
            raise ValueError("a TTL estimator goes with the TTL rule, and only with it")
        if (self.order is Order.BOOST) != (self.boost_gamma is not None):
            raise ValueError("a boost γ goes with the BOOST order, and only with it")
        if self.boost_gamma is not None and not (self.boost_gamma > 0 and math.isfinite(self.boost_gamma)):
            raise ValueError(f"boost γ must be a number > 0, got {self.boost_gamma}")
        if self.size_labels is not None and self.order is not Order.BOOST:
            raise ValueError("size labels go with the BOOST order, and only with it")
        if (self.order is Order.NUDGE) != (self.nudge_m is not None):
            raise ValueError("a nudge window M goes with the NUDGE order, and only with it")
        if self.nudge_m is not None and (isinstance(self.nudge_m, bool) or not isinstance(self.nudge_m, int)
                                         or self.nudge_m < 1):
            raise ValueError(f"nudge window M must be a whole number >= 1, got {self.nudge_m!r}")

    # --- strategies -------------------------------------------------------------------

    @property
    def requeues_at_tail(self) -> bool:
        return self.rule is StrategyRule.END_AT_CALL

    @property
    def reconsiders_paused(self) -> bool:
        return self.rule in (StrategyRule.AT_CALL, StrategyRule.BUDGETED, StrategyRule.TTL)

    @property
    def releases_pins(self) -> bool:
        """Whether preserved calls are given up, newest program first, before a running request is
        preempted or while a waiting one does not fit (Continuum's pins under pressure)."""
        return self.rule is StrategyRule.TTL

    @property
    def keys_follow_load(self) -> bool:
        """Whether queue keys change with the engine's load, so that they need refreshing."""
        return self.order in (Order.MEMORY_TIME, Order.BOOST)

    @property
    def ranks_by_program_arrival(self) -> bool:
        """Whether a conversation's turn over HTTP takes its program's first arrival as its place in
        the arrival order (`RequestProgress.order_s`). In the simulator a request keeps its arrival
        across its calls unless the policy requeues it at the tail when a call ends; over HTTP a
        program's calls are its turns, each a request of its own. The place is what FCFS orders
        (INFERCEPT's), Boost's `a` and Nudge's place read, and where a promotion for life ranks in
        the promoted lane (`queue.py`)."""
        return not self.requeues_at_tail

    @property
    def knows_future(self) -> bool:
        """Whether the key reads the trace's later segments (`RestRule.PLAN`): a bound."""
        return self.rest is RestRule.PLAN

    def start_segment(self, progress: RequestProgress, load: EngineLoad) -> None:
        """Called when a segment becomes current (arrival, call return): predict, and fix the
        strategy now if this policy decides ahead."""
        if progress.segment_index:
            index = progress.segment_index - 1
            self._segment_ended(progress, index, progress.request.segments[index].output_tokens)
        if not self.knows_future:
            self._start_segment_from_past(progress, load)
            return
        request = progress.request
        # Earlier segments keep the predictions they had (they are done); the current and later
        # ones are predicted anew, with what the estimators have learnt since.
        index = progress.segment_index
        done = progress.predictions[:index] if len(progress.predictions) == len(request.segments) else [
            self.predictor.predict(request, i) for i in range(index)]
        progress.predictions = done + [self.predictor.predict(request, i) for i in range(index, len(request.segments))]
        progress.strategy = None
        if progress.segment.api is None or progress.in_last_segment:
            return  # no call, or a trailing call: the request's KV is freed at it, nothing to decide
        self._assign_ahead(progress, load)

    def _start_segment_from_past(self, progress: RequestProgress, load: EngineLoad) -> None:
        """`start_segment` knowing only the request's past (`workload/past.py`): the current
        segment is predicted, the rest comes from the requests that ended (`program_rest.py`),
        and a strategy is fixed ahead for the call the segment may end with."""
        request, index = progress.request, progress.segment_index
        if index:  # the segment before is done: its length is the past now
            self.predictor.observe_output(RequestPast.of(request, index - 1), request.segments[index - 1].output_tokens)
        past = RequestPast.of(request, index)
        prediction = self.predictor.predict(request, index)
        outlook, counts = self.program_rest.outlook(past, prediction.output_tokens)
        prediction.has_call = call_chance(counts) >= 0.5
        prediction.kept_tokens = None  # a compaction shows only when the next segment arrives
        done = progress.predictions[:index]
        progress.predictions = done + [prediction] * (index + 1 - len(done))
        progress.program = outlook
        progress.rest_counts = counts if self.rest is RestRule.GITTINS else None
        progress.strategy = None
        self._assign_ahead(progress, load)

    def _assign_ahead(self, progress: RequestProgress, load: EngineLoad) -> None:
        """Fix the current segment's strategy now, if this policy decides ahead."""
        index = progress.segment_index
        if self.rule is StrategyRule.FIXED:
            progress.assign(StrategyAssignment(index, self.fixed_strategy, load.now_s, 0, 0.0, "fixed"))
        elif self.rule is StrategyRule.AHEAD:
            prediction = progress.predictions[index]
            context = progress.segment.context_tokens + prediction.output_tokens
            # Ahead of time the host's room at the call is unknown: the engine falls back if it is full.
            strategy = self._cheapest(context, prediction.api_duration_s, load, swap_allowed=True,
                                      kept_tokens=prediction.kept_tokens)
            progress.assign(
                StrategyAssignment(index, strategy, load.now_s, context, prediction.api_duration_s, "ahead")
            )

    def strategy_at_call(self, progress: RequestProgress, load: EngineLoad) -> Strategy:
        """The strategy for the call starting now. AHEAD and FIXED return what was fixed before."""
        if self.rule is StrategyRule.END_AT_CALL:
            progress.assign(StrategyAssignment(progress.segment_index, Strategy.DISCARD, load.now_s, 0, 0.0, "fixed"))
        elif self.rule is StrategyRule.BUDGETED:  # every call starts preserved; the engine revisits it
            progress.assign(StrategyAssignment(progress.segment_index, Strategy.PRESERVE, load.now_s,
                                               progress.computed_tokens, progress.segment.api.duration_s, "at-call"))
        elif self.rule is StrategyRule.TTL:
            ttl = self.ttl.ttl_s(progress.segment.api.api_type.value, progress.computed_tokens)
            strategy = Strategy.PRESERVE if ttl > 0 else Strategy.DISCARD
            # For a pin, `api_s` is the time-to-live: the pin's end is the call's start plus it.
            progress.assign(StrategyAssignment(progress.segment_index, strategy, load.now_s, progress.computed_tokens,
                                               ttl, "ttl"))
        elif self.rule is StrategyRule.AT_CALL:
            api_s = self.call_time_s(progress)
            strategy = self._cheapest(progress.computed_tokens, api_s, load, kept_tokens=self._kept(progress))
            progress.assign(
                StrategyAssignment(progress.segment_index, strategy, load.now_s, progress.computed_tokens, api_s, "at-call")
            )
        return progress.strategy

    def reconsider(self, progress: RequestProgress, load: EngineLoad) -> Strategy | None:
        """For AT_CALL, while a call is preserved: a cheaper strategy given the remaining time, or None.
        For TTL: discard once the pin's time-to-live is over."""
        if self.rule is StrategyRule.TTL and progress.strategy is Strategy.PRESERVE:
            if load.now_s < self.pin_expiry_s(progress):
                return None
            return self.release_pin(progress, load, "ttl-expired")
        if self.rule is not StrategyRule.AT_CALL or progress.strategy is not Strategy.PRESERVE:
            return None
        remaining_s = self.remaining_call_s(progress, load)
        strategy = self._cheapest(progress.computed_tokens, remaining_s, load, kept_tokens=self._kept(progress))
        if strategy is Strategy.PRESERVE:
            return None
        progress.assign(
            StrategyAssignment(
                progress.segment_index, strategy, load.now_s, progress.computed_tokens, remaining_s, "reconsidered"
            )
        )
        return strategy

    @staticmethod
    def pin_expiry_s(progress: RequestProgress) -> float:
        """When a TTL pin on the current call ends."""
        return progress.api_started_s + progress.assignments[-1].api_s

    def release_pin(self, progress: RequestProgress, load: EngineLoad, reason: str = "pressure") -> Strategy:
        """Give up a pinned call's KV (its TTL ended, or memory ran short): discard."""
        progress.assign(StrategyAssignment(progress.segment_index, Strategy.DISCARD, load.now_s,
                                           progress.computed_tokens, 0.0, reason))
        return Strategy.DISCARD

    def observe_call(self, api_type: str, duration_s: float) -> None:
        """A call returned after `duration_s` (the TTL rule learns tool times from it)."""
        if self.ttl is not None:
            self.ttl.observe_call(api_type, duration_s)

    def observe_admission(self, progress: RequestProgress, wait_s: float) -> None:
        """A request left the queue after `wait_s`. The TTL rule's queueing delay counts the turns
        whose program lost its KV at the call before (Continuum's `SlidingWindowMean`)."""
        if self.ttl is None or progress.segment_index == 0 or progress.generated:
            return
        before = [a for a in progress.assignments if a.segment_index == progress.segment_index - 1]
        if before and before[-1].strategy is Strategy.DISCARD:
            self.ttl.observe_queue_delay(wait_s)

    def observe_finish(self, progress: RequestProgress, last_output_tokens: int | None = None) -> None:
        """A program finished: its turns feed the TTL rule's η, and its segments what the policy
        learns of the rest of programs (`program_rest.py`). `last_output_tokens`: what the last
        segment generated, where the request's segments hold a plan instead (vLLM: max_tokens)."""
        request = progress.request
        last = len(request.segments) - 1
        output = request.segments[last].output_tokens if last_output_tokens is None else last_output_tokens
        self._segment_ended(progress, last, output)
        if self.ttl is not None:
            self.ttl.observe_program(len(request.segments))
        if not self.knows_future or self.plan_is_declared:
            self.predictor.observe_output(RequestPast.of(request, last), output)
        if not self.knows_future:
            self.program_rest.ended(request.task_class, request.segments)

    def _segment_ended(self, progress: RequestProgress, index: int, output_tokens: int) -> None:
        """Segment `index` generated `output_tokens`: the size labels learn how its prediction did."""
        if self.size_labels is not None and index < len(progress.predictions):
            self.size_labels.observe(progress.request.segments[index].context_tokens,
                                     progress.predictions[index].output_tokens, output_tokens)

    def host_full_fallback(self, progress: RequestProgress, load: EngineLoad) -> Strategy:
        """The call was to swap but host memory has no room: the cheaper of preserve and discard."""
        index = progress.segment_index
        if self.rule is StrategyRule.AT_CALL:
            api_s = self.remaining_call_s(progress, load)
        else:
            api_s = progress.predictions[index].api_duration_s
        strategy = self._cheapest(progress.computed_tokens, api_s, load, swap_allowed=False,
                                  kept_tokens=self._kept(progress))
        progress.assign(StrategyAssignment(index, strategy, load.now_s, progress.computed_tokens, api_s, "host-full"))
        return strategy

    def strategy_for_gap(self, context_tokens: int, gap_s: float, load: EngineLoad) -> Strategy:
        """The strategy for `context_tokens` idle for a predicted `gap_s` outside any plan (a
        conversation between its turns): this policy's rule, with the prediction as the call time."""
        if self.rule is StrategyRule.FIXED:
            return self.fixed_strategy
        if self.rule in (StrategyRule.END_AT_CALL, StrategyRule.TTL):
            return Strategy.DISCARD
        return self._cheapest(context_tokens, gap_s, load)

    def call_time_s(self, progress: RequestProgress) -> float:
        """The current call's duration as the AT_CALL rule reads it: the true one (INFERCEPT's
        oracle) or the predicted one (`reads_true_call_time`)."""
        if self.reads_true_call_time:
            return progress.segment.api.duration_s
        return progress.predictions[progress.segment_index].api_duration_s

    def remaining_call_s(self, progress: RequestProgress, load: EngineLoad) -> float:
        """The time left in the current call, as `call_time_s` reads its duration."""
        return self.call_time_s(progress) - (load.now_s - progress.api_started_s)

    @staticmethod
    def _kept(progress: RequestProgress) -> int | None:
        """The current call's compaction, as predicted (`SegmentPrediction.kept_tokens`)."""
        return progress.predictions[progress.segment_index].kept_tokens

    def _cheapest(self, context_tokens: int, api_s: float, load: EngineLoad, swap_allowed: bool | None = None,
                  kept_tokens: int | None = None) -> Strategy:
        wastes = call_wastes(context_tokens, api_s, load.running_kv_tokens, self.cost, kept_tokens)
        if swap_allowed is None:
            swap_allowed = load.host_free_tokens >= context_tokens
        return cheapest(wastes, swap_allowed=swap_allowed)

    # --- starvation protection and admission ------------------------------------------

    def protect(self, progress: RequestProgress, iteration: int) -> None:
        """A promoted request is being admitted: protect it from preemption."""
        progress.promoted = False
        if self.starvation.protection is Protection.QUANTUM:
            progress.protected_until_iteration = iteration + self.starvation.quantum
        else:
            progress.protected_segment = progress.segment_index

    def is_protected(self, progress: RequestProgress, iteration: int) -> bool:
        if self.starvation.protection is Protection.QUANTUM:
            return progress.protected_until_iteration > iteration
        return progress.protected_segment == progress.segment_index

    def kv_outlook(self, progress: RequestProgress) -> KvOutlook:
        """The request's device KV over its current segment, from the predictions."""
        prediction = progress.predictions[progress.segment_index]
        decode_left = max(prediction.output_tokens - progress.generated, 1)
        last = progress.in_last_segment if self.knows_future else not prediction.has_call
        held_after = progress.strategy is Strategy.PRESERVE and not last
        return KvOutlook(progress.context_tokens, decode_left, held_after)

    def looks_at_batch(self, batch_running: bool) -> bool:
        """Whether admission weighs the running batch's outlooks: not under greedy admission, and
        never for an empty batch (an empty engine always takes the head)."""
        return self.admission is not Admission.GREEDY and batch_running

    def admits(self, candidate: RequestProgress, running: list[RequestProgress], other_tokens: int,
               capacity_tokens: int, block_tokens: int) -> bool:
        """Whether `candidate` may join `running` now. `other_tokens` is device KV held outside the
        batch (preserved calls, transfers). Always true for greedy admission."""
        if not self.looks_at_batch(bool(running)):
            return True
        return self.admits_outlooks(self.kv_outlook(candidate), [self.kv_outlook(p) for p in running],
                                    other_tokens, capacity_tokens, block_tokens)

    def admits_outlooks(self, candidate: KvOutlook, running: list[KvOutlook], other_tokens: int,
                        capacity_tokens: int, block_tokens: int) -> bool:
        """`admits` from outlooks an engine already has (it may keep them for a step)."""
        if not self.looks_at_batch(bool(running)):
            return True
        # A full block per request bounds the partly filled last block: with exact predictions,
        # what is admitted never outgrows the device.
        peak = predicted_peak_tokens([*running, candidate], rounding_tokens=block_tokens)
        return other_tokens + peak <= capacity_tokens

    # --- order ------------------------------------------------------------------------

    def queue_key(self, progress: RequestProgress, load: EngineLoad) -> float:
        """Lower runs first."""
        return self.queue_key_form(progress, load).at(load.iteration_s)

    def queue_key_form(self, progress: RequestProgress, load: EngineLoad) -> KeyForm:
        """The queue key as a line in the iteration time (`ranking.KeyForm`): valid while the
        request's progress does not change (and, if it follows the running KV, the load)."""
        if self.order is Order.MEMORY_TIME:
            return self.memory_time_form(progress, load)
        if self.order is Order.BOOST:
            return self.boost_form(progress, load)
        if self.order is Order.NUDGE:  # its place: the arrival, or the one a swap gave it (`queue.py`)
            return KeyForm(0.0, progress.order_s)
        if self.order is Order.REMAINING_TOKENS:
            return KeyForm(0.0, float(self.remaining_tokens(progress)))
        if self.order is Order.LEAST_ATTAINED:
            return KeyForm(0.0, plas_key(progress.attained_before_segment,
                                         progress.attained_iterations - progress.attained_before_segment,
                                         progress.order_s))
        return KeyForm(0.0, progress.order_s)

    def victim_key(self, progress: RequestProgress, load: EngineLoad) -> float:
        """Higher is preempted first: the lowest-ranked request."""
        return self.queue_key(progress, load)

    def remaining_tokens(self, progress: RequestProgress) -> int:
        predictions = progress.predictions[progress.segment_index :]
        rest = 0 if progress.program is None else round(progress.program.turns_left * progress.program.output_tokens)
        return (max(predictions[0].output_tokens - progress.generated, 1) + sum(p.output_tokens for p in predictions[1:])
                + rest)

    def memory_time(self, progress: RequestProgress, load: EngineLoad) -> float:
        return self.memory_time_form(progress, load).at(load.iteration_s)

    def memory_time_form(self, progress: RequestProgress, load: EngineLoad) -> KeyForm:
        outlook, running_kv = self._outlook(progress, load)
        form = remaining_area_form(outlook, self.cost, self.terms,
                                   follows_running_kv=self._later_strategies_follow_load(progress),
                                   running_kv=running_kv, recompute_time=self.recompute_time)
        if progress.program is None:
            return form
        # The program's turns to come (`program.py`): a conversation's over HTTP, or the segments
        # a request has left, as learnt from those that ended (`program_rest.py`).
        if progress.rest_counts is not None:  # the Gittins rank's horizon, at the τ now
            program = progress.program
            progress.program = gittins_outlook(progress.rest_counts, form.at(load.iteration_s), progress.context_tokens,
                                               program.output_tokens, program.growth_tokens, load.iteration_s)
        rest = rest_area_per_iteration(progress.program, progress.context_tokens)
        chance = progress.program.completion
        if chance == 1.0:
            return replace(form, per_iteration_s=form.per_iteration_s + rest)
        return replace(form, per_iteration_s=(form.per_iteration_s + rest) / chance, fixed=form.fixed / chance)

    def boost_form(self, progress: RequestProgress, load: EngineLoad) -> KeyForm:
        """The Boost rank from MARS's key at the τ now (a constant until the queue rebuilds it: a
        boost moves little with τ), valid over the same range of running KV."""
        form, size_s = self._device_size(progress, load)
        if self.size_labels is None or progress.segment_index >= len(progress.predictions):
            key = boost_key(progress.order_s, size_s, self.boost_gamma)
        else:
            predicted = progress.predictions[progress.segment_index].output_tokens
            key = progress.order_s - boost_from_excess(self.size_labels.excess(size_s, predicted, self.boost_gamma),
                                                       self.boost_gamma)
        return KeyForm(0.0, key, form.follows_running_kv, form.running_kv_from, form.running_kv_below)

    def device_size_s(self, progress: RequestProgress, load: EngineLoad) -> float:
        """A request's size for Boost and Nudge: MARS's key over the device's KV capacity, the
        seconds of the whole device its rest would take."""
        return self._device_size(progress, load)[1]

    def _device_size(self, progress: RequestProgress, load: EngineLoad) -> tuple[KeyForm, float]:
        if load.kv_capacity_tokens <= 0:
            raise ValueError(f"the {self.order.value} order needs the engine's KV capacity "
                             "(EngineLoad.kv_capacity_tokens)")
        form = self.memory_time_form(progress, load)
        return form, form.at(load.iteration_s) / load.kv_capacity_tokens

    def _later_strategies_follow_load(self, progress: RequestProgress) -> bool:
        """Whether `outlook` picks a later call's strategy by waste (which weighs the running KV)."""
        if self.rule in (StrategyRule.FIXED, StrategyRule.END_AT_CALL):
            return False
        last = len(progress.predictions) - 1
        return any(progress.predictions[i].has_call for i in range(progress.segment_index + 1, last))

    def outlook(self, progress: RequestProgress, load: EngineLoad) -> list[SegmentOutlook]:
        """The current and later segments as the ranking key sees them (see `ranking.py`)."""
        return self._outlook(progress, load)[0]

    def _outlook(self, progress: RequestProgress, load: EngineLoad
                 ) -> tuple[list[SegmentOutlook], tuple[float, float]]:
        """`outlook`, and the range of running-batch KV over which its later strategies stay the
        same. Each later call priced here carries its costs, which its key term reuses."""
        low, high = 0, math.inf
        by_waste = self.rule not in (StrategyRule.FIXED, StrategyRule.END_AT_CALL)
        index = progress.segment_index
        current = progress.predictions[index]
        outlook = [
            SegmentOutlook(
                progress.context_tokens,
                progress.pending_tokens,
                max(current.output_tokens - progress.generated, 1),
                current,
                progress.strategy,
            )
        ]
        context_at_call = progress.context_tokens + outlook[0].decode_tokens
        last = len(progress.predictions) - 1
        for later_index in range(index + 1, last + 1):
            previous = progress.predictions[later_index - 1]
            prediction = progress.predictions[later_index]
            context = next_context(context_at_call, previous.kept_tokens, previous.api_return_tokens)
            # What the call leaves cached: all but the last token sampled before it, or the kept prefix.
            prefill = context - cached_after_call(context_at_call - 1, previous.kept_tokens, context)
            strategy = None
            call = None
            if prediction.has_call and later_index < last:
                call = CallCosts.of(context + prediction.output_tokens, prediction.api_duration_s, self.cost,
                                    prediction.kept_tokens, self.recompute_time)
                strategy = self._later_strategy(call, load)
                if by_waste:
                    bound = call.discard_cheapest_below()
                    if strategy is Strategy.DISCARD:
                        high = min(high, bound)
                    else:
                        low = max(low, bound)
            outlook.append(SegmentOutlook(context, prefill, prediction.output_tokens, prediction, strategy, call))
            context_at_call = context + prediction.output_tokens
        return outlook, (low, high)

    def recompute_time(self, tokens: int) -> float:
        """`cost.recompute_time(tokens)`, memoised (at most `_RECOMPUTE_MEMO` token counts)."""
        cost, memo = self._recompute_memo
        if cost is not self.cost:
            cost, memo = self._recompute_memo = (self.cost, {})
        seconds = memo.get(tokens)
        if seconds is None:
            if len(memo) >= _RECOMPUTE_MEMO:
                memo.clear()
            seconds = memo[tokens] = cost.recompute_time(tokens)
        return seconds

    def _later_strategy(self, call: CallCosts, load: EngineLoad) -> Strategy:
        if self.rule is StrategyRule.FIXED:
            return self.fixed_strategy
        if self.rule is StrategyRule.END_AT_CALL:
            return Strategy.DISCARD
        return call.cheapest(load.running_kv_tokens)

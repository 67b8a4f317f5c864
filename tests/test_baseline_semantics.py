"""What each named policy does: the baselines' order and call handling, and MARS's ranking key
and ahead-of-time decision, on small runs and hand-computed keys.

The test engine of `simhelpers`: 16-token blocks, `t(n) = 10 ms + 0.05 ms·n`, a 128-token
budget (so Tfwd(n) = t(n) for n ≤ 128), a 20,000 tokens/s host link. Expected values are
worked out in the comments from the formulas of `policy/ranking.py` and `policy/waste.py`.
"""

from __future__ import annotations

import pytest

from marsched.metrics.trace import EventTrace
from marsched.policy import CostModel, Order, Policy, Strategy, StrategyRule, make_policy
from marsched.policy.load import EngineLoad
from marsched.policy.progress import RequestProgress
from marsched.policy.ranking import RankingTerms, decode_area
from marsched.predict import ApiEstimate, SegmentPredictor
from marsched.sim.engine import Simulator
from marsched.sim.profile import Profile
from marsched.workload import ApiCall, ApiType, build_request
from simhelpers import COST, single, small_profile, two_segment

FCFS_POLICIES = ["vllm", "infercept", "preserve", "discard", "swap"]
TAU = 0.01
LOAD = EngineLoad(now_s=0.0, running_kv_tokens=0, iteration_s=TAU, host_free_tokens=10**9)


class Recorder(EventTrace):
    enabled = True

    def __init__(self) -> None:
        self.events: list[dict] = []

    def emit(self, event: str, t: float, rid: str | None = None, **fields) -> None:
        self.events.append({"event": event, "t": t, "rid": rid, **fields})


def _run(requests, policy, profile):
    trace = Recorder()
    result = Simulator(requests, profile, policy, trace=trace).run()
    return result, trace.events


def _events(events, rid, kind):
    return [e for e in events if e["rid"] == rid and e["event"] == kind]


def _admissions(events):
    return [(e["rid"], e["segment"], e["t"]) for e in events if e["event"] == "admit"]


# --- 2. stock vLLM re-queues at the tail after a call; INFERCEPT keeps arrival order --------


def _requeue_workload():
    # 8 blocks = 128 tokens, no host memory (INFERCEPT cannot swap).
    # A (arrives first) calls a 0.1 s API after 5 tokens; H fills the device meanwhile;
    # B arrives during A's call and cannot fit beside H. When H finishes both wait, and
    # B (100 tokens, 7 blocks) and A (29 tokens, 2 blocks) do not fit together.
    return [
        two_segment("A", 0.0, 20, 5, 0.1, 4, 5),
        single("H", 0.001, 90, 30),
        single("B", 0.07, 100, 10),
    ]


@pytest.mark.parametrize("policy_name, first", [("vllm", "B"), ("infercept", "A")])
def test_after_a_call_vllm_queues_behind_later_arrivals_infercept_does_not(policy_name, first):
    _, events = _run(_requeue_workload(), make_policy(policy_name, COST), small_profile(device_blocks=8, host_blocks=0))
    api_start = _events(events, "A", "api_start")[0]
    api_end = _events(events, "A", "api_end")[0]
    arrive_b = _events(events, "B", "arrive")[0]
    finish_h = _events(events, "H", "finish")[0]
    # The setting: A discards at its call, B arrives during it, both are still waiting when H ends.
    assert api_start["strategy"] == "discard"
    assert api_start["t"] < arrive_b["t"] < api_end["t"] < finish_h["t"]
    assert _events(events, "A", "resume")[0]["where"] == "waiting"
    later = [(rid, t) for rid, segment, t in _admissions(events) if t >= api_end["t"]]
    assert [rid for rid, _ in later] == [first, "B" if first == "A" else "A"]
    # The first is admitted when H finishes; the other only when the first is done.
    assert later[0][1] == pytest.approx(finish_h["t"])
    assert later[1][1] == pytest.approx(_events(events, first, "finish")[0]["t"])


# --- 3. FCFS baselines admit the earliest arrival first --------------------------------------


@pytest.mark.parametrize("policy_name", FCFS_POLICIES)
def test_fcfs_baselines_admit_in_arrival_order_when_the_engine_is_full(policy_name):
    # H fills the 8 blocks; X1, X2, X3 arrive while it runs, each too large to run beside another
    # (60–80 tokens: 4–5 blocks at the start, 6 at the end). Their lengths are chosen so that any
    # order but arrival order differs: X3 has the shortest output and the least memory × time,
    # X1 the longest, so SJF or MARS would take X3 first.
    requests = [single("H", 0.0, 90, 20), single("X1", 0.02, 60, 30), single("X2", 0.03, 70, 20),
                single("X3", 0.04, 80, 10)]
    _, events = _run(requests, make_policy(policy_name, COST), small_profile(device_blocks=8))
    admitted = _admissions(events)
    assert [rid for rid, _, _ in admitted] == ["H", "X1", "X2", "X3"]
    times = [t for _, _, t in admitted]
    assert times[0] < times[1] < times[2] < times[3]  # one at a time: each waited for the previous
    assert times[1] == pytest.approx(_events(events, "H", "finish")[0]["t"])


@pytest.mark.parametrize("policy_name", FCFS_POLICIES)
def test_fcfs_key_is_the_arrival_time(policy_name):
    policy = make_policy(policy_name, COST)
    keys = []
    for rid, arrival in (("early", 1.0), ("late", 2.0)):
        progress = RequestProgress(single(rid, arrival, 500, 400), order_s=arrival)
        policy.start_segment(progress, LOAD)
        keys.append(policy.queue_key(progress, LOAD))
    assert keys == [1.0, 2.0]


# --- 4. every term of MARS's ranking key counts ----------------------------------------------
#
# remaining area = prefill Tfwd(pending)·P + decode τ·(L·P + L(L+1)/2) + call (Preserve C·T,
# Discard Tfwd(C)·C, Swap 2·(C / bandwidth)·C, C = P + L) + the same for each later segment
# (context = previous C + return, prefill of return + 1 tokens, its own call if not last).
#
# The base request of the pairs: a 50-token prompt, 10 tokens, a call returning 5 tokens, 10 more.
#   current: prefill Tfwd(50)·50 = t(50)·50 = 0.0125·50 = 0.625
#            decode  0.01·(10·50 + 55) = 5.55;  C = 60
#   later:   context 65, prefill Tfwd(6)·65 = 0.0103·65 = 0.6695
#            decode  0.01·(10·65 + 55) = 7.05;  the last segment has no call
BASE = 0.625 + 5.55 + 0.6695 + 7.05  # 13.8945, without the current call's term


def _key(policy, request, **progress_fields):
    progress = RequestProgress(request, order_s=0.0, **progress_fields)
    policy.start_segment(progress, LOAD)
    return progress, policy.queue_key(progress, LOAD)


def _base(api_s, second=10, rid="r"):
    return two_segment(rid, 0.0, 50, 10, api_s, 5, second)


def test_key_counts_the_call_time_of_a_preserved_call():
    # At C = 60 and K = 0: Swap 2·60/20000·60 = 0.36 and Discard 0.013·60 = 0.78, so calls of
    # 1 ms and 4 ms are preserved, at 60·T = 0.06 and 0.24.
    mars = make_policy("mars", COST)
    short, short_key = _key(mars, _base(0.001))
    long, long_key = _key(mars, _base(0.004))
    assert short.strategy is long.strategy is Strategy.PRESERVE
    assert short_key == pytest.approx(BASE + 0.06)
    assert long_key == pytest.approx(BASE + 0.24)
    assert short_key < long_key


def test_key_counts_the_prefill_still_owed():
    # The same request at the same point (context 60, 10 of 30 tokens generated, 20 to go):
    # running, with 59 tokens computed, it owes 1; preempted, it owes all 60.
    #   decode 0.01·(20·60 + 210) = 14.1
    #   running:   Tfwd(1)·60 = 0.01005·60 = 0.603
    #   preempted: Tfwd(60)·60 = 0.013·60 = 0.78
    mars = make_policy("mars", COST)
    request = single("r", 0.0, 50, 30)
    _, running = _key(mars, request, context_tokens=60, generated=10, computed_tokens=59)
    _, preempted = _key(mars, request, context_tokens=60, generated=10, computed_tokens=0)
    assert running == pytest.approx(14.1 + 0.603)
    assert preempted == pytest.approx(14.1 + 0.78)
    assert running < preempted


def test_key_counts_the_decode_triangle():
    # Same prompt, 10 or 40 tokens: 0.01·(10·50 + 55) = 5.55 and 0.01·(40·50 + 820) = 28.2,
    # each after the prefill 0.625.
    mars = make_policy("mars", COST)
    _, short = _key(mars, single("a", 0.0, 50, 10))
    _, long = _key(mars, single("b", 0.0, 50, 40))
    assert short == pytest.approx(0.625 + 5.55)
    assert long == pytest.approx(0.625 + 28.2)


def test_key_counts_the_swap_transfers():
    # A 5 s call is swapped (Preserve 300, Discard 0.78, Swap 0.36 at 20,000 tokens/s and 0.72 at
    # 10,000). The host link's speed changes nothing but the swap term 2·(60/bandwidth)·60.
    slow_link = CostModel(COST.seconds_per_token, COST.seconds_per_iteration, COST.token_budget, 10_000)
    fast, fast_key = _key(make_policy("mars", COST), _base(5.0))
    slow, slow_key = _key(make_policy("mars", slow_link), _base(5.0))
    assert fast.strategy is slow.strategy is Strategy.SWAP
    assert fast_key == pytest.approx(BASE + 0.36)
    assert slow_key == pytest.approx(BASE + 0.72)
    assert fast_key < slow_key


def _memory_time_fixed(strategy):
    """The memory × time order with one fixed strategy: keys that differ only by the call's strategy."""
    return Policy("mt-" + strategy.value, Order.MEMORY_TIME, StrategyRule.FIXED, COST,
                  SegmentPredictor.oracle(), fixed_strategy=strategy)


def test_key_counts_the_current_strategy_cost_of_the_call():
    # A 1 s call at C = 60: Preserve 60·1 = 60, Discard Tfwd(60)·60 = 0.78, Swap 0.36.
    request = _base(1.0)
    keys = {}
    for strategy in Strategy:
        progress, keys[strategy] = _key(_memory_time_fixed(strategy), request)
        assert progress.strategy is strategy
    assert keys[Strategy.PRESERVE] == pytest.approx(BASE + 60)
    assert keys[Strategy.DISCARD] == pytest.approx(BASE + 0.78)
    assert keys[Strategy.SWAP] == pytest.approx(BASE + 0.36)
    # The strategy assigned to the segment is the one counted, even where min-waste would differ.
    mars = make_policy("mars", COST)
    progress = RequestProgress(request, order_s=0.0)
    mars.start_segment(progress, LOAD)
    assert progress.strategy is Strategy.SWAP
    progress.strategy = Strategy.PRESERVE  # as after a host-full fallback
    assert mars.queue_key(progress, LOAD) == pytest.approx(BASE + 60)


def test_key_counts_the_later_segments():
    # Second segments of 10 and 40 tokens from context 65: decode 7.05 vs 0.01·(40·65 + 820) = 34.2.
    mars = make_policy("mars", COST)
    _, short_key = _key(mars, _base(0.001, second=10))
    _, long_key = _key(mars, _base(0.001, second=40))
    assert short_key == pytest.approx(BASE + 0.06)
    assert long_key == pytest.approx(BASE - 7.05 + 34.2 + 0.06)
    assert short_key < long_key


def test_key_counts_a_later_call_under_the_strategy_the_waste_rule_picks():
    # Three segments: 50-token prompt, 10 tokens, 1 ms call returning 5; 10 tokens, a call of T2
    # returning 5; 10 tokens.
    #   current: 0.625 + 5.55 + 60·0.001 = 6.235
    #   second:  context 65: prefill 0.0103·65 = 0.6695, decode 7.05; C2 = 75:
    #            T2 = 1 ms: Preserve 0.075 (Swap 2·75/20000·75 = 0.5625, Discard 0.01375·75 = 1.03)
    #            T2 = 5 s:  Swap 0.5625
    #   third:   context 80: prefill 0.0103·80 = 0.824, decode 0.01·(10·80 + 55) = 8.55
    without_call = 6.235 + 0.6695 + 7.05 + 0.824 + 8.55
    mars = make_policy("mars", COST)

    def three(api2_s):
        first = ApiCall(ApiType.OTHER, 0.001, 5)
        return build_request("r", 50, [(10, first), (10, ApiCall(ApiType.OTHER, api2_s, 5)), (10, None)])

    _, short_key = _key(mars, three(0.001))
    _, long_key = _key(mars, three(5.0))
    assert short_key == pytest.approx(without_call + 0.075)
    assert long_key == pytest.approx(without_call + 0.5625)


@pytest.mark.parametrize(
    "off, expected",
    [
        # The base request with a 1 ms preserved call, term by term (see BASE above):
        # current prefill 0.625, decode 5.55, call 0.06; later prefill 0.6695, decode 7.05.
        ({}, 0.625 + 5.55 + 0.06 + 0.6695 + 7.05),
        ({"prefill": False}, 5.55 + 0.06 + 7.05),
        ({"decode": False}, 0.625 + 0.06 + 0.6695),
        ({"call": False}, 0.625 + 5.55 + 0.6695 + 7.05),
        ({"after_call": False}, 0.625 + 5.55 + 0.06),
    ],
)
def test_each_ablation_flag_removes_exactly_its_term(off, expected):
    mars = make_policy("mars", COST, terms=RankingTerms(**off))
    progress, key = _key(mars, _base(0.001))
    assert progress.strategy is Strategy.PRESERVE  # the flags change the key, not the strategy
    assert key == pytest.approx(expected)


def test_decode_area_of_nothing_is_zero():
    # No tokens left to decode hold no memory over time, whatever the context.
    assert decode_area(100, 0, 0.01) == 0
    assert decode_area(100, -3, 0.01) == 0
    assert decode_area(100, 1, 0.01) == pytest.approx(0.01 * 101)


# --- 7. INFERCEPT revisits a preserved call with the time left in it -------------------------


def test_infercept_reconsiders_with_the_remaining_call_time():
    # Context 100 computed, a 1 s call started at t = 0, nothing else running (K = 0), no host room.
    # Discard wastes Tfwd(100)·100 = 0.015·100 = 1.5; Preserve 100·(1 − elapsed). Preserving stays
    # more wasteful until 1 − elapsed = 0.015, at elapsed = 0.985 s.
    policy = make_policy("infercept", COST)
    request = two_segment("a", 0.0, 91, 10, 1.0, 4, 4)

    def paused():
        progress = RequestProgress(request, order_s=0.0, computed_tokens=100, context_tokens=101, generated=10)
        policy.start_segment(progress, LOAD)
        progress.api_started_s = 0.0
        progress.strategy = Strategy.PRESERVE
        return progress

    def at(now_s):
        return EngineLoad(now_s=now_s, running_kv_tokens=0, iteration_s=TAU, host_free_tokens=0)

    early = paused()
    assert policy.reconsider(early, at(0.98)) is Strategy.DISCARD
    assert early.assignments[-1].api_s == pytest.approx(0.02)  # the time left, not the 1 s of the call
    assert early.assignments[-1].reason == "reconsidered"
    late = paused()
    assert policy.reconsider(late, at(0.99)) is None  # 100·0.01 = 1 < 1.5: keep it
    assert late.strategy is Strategy.PRESERVE


# A slow engine (1 ms per token) makes the recompute long enough to see the crossing in a run.
_SLOW = CostModel(seconds_per_token=1e-3, seconds_per_iteration=0.01, token_budget=256, swap_tokens_per_s=20_000)


def _slow_t(tokens: int) -> float:
    return 0.01 + 1e-3 * tokens


@pytest.mark.parametrize("h_output, switches", [(16, True), (20, False)])
def test_infercept_switches_a_preserved_call_once_keeping_it_costs_more(h_output, switches):
    # A (90-token prompt, 10 tokens, a 0.2 s call) runs beside H (100-token prompt). No host memory.
    # Both prefill at t = 0 in one iteration of 190 tokens (0.2 s), then decode two at a time
    # (12 ms): A calls after 9 of them, at 0.2 + 9·0.012 = 0.308 s, with C = 99 computed and H
    # holding K = 109. Preserve 99·0.2 = 19.8 < Discard Tfwd(99)·(99 + 109) = 0.109·208 = 22.67:
    # A preserves. H then decodes alone (11 ms per token) and ends h_output − 10 iterations later.
    # From then on K = 0 and Discard costs 0.109·99 = 10.79: preserving is more wasteful while
    # more than 10.79 / 99 = 0.109 s of the call is left, i.e. until 0.308 + 0.2 − 0.109 = 0.399 s.
    #   h_output 16: H ends at 0.308 + 6·0.011 = 0.374 s, 0.134 s left: A switches to Discard then.
    #   h_output 20: H ends at 0.308 + 10·0.011 = 0.418 s, 0.09 s left: A keeps its KV.
    requests = [two_segment("A", 0.0, 90, 10, 0.2, 5, 5), single("H", 0.0, 100, h_output)]
    profile = Profile("slow", "test engine, 1 ms per token", 1.0, 64, 0, 16, _SLOW)
    result, events = _run(requests, make_policy("infercept", _SLOW), profile)
    call_start = _slow_t(190) + 9 * _slow_t(2)
    h_end = call_start + (h_output - 10) * _slow_t(1)
    assigned = _events(events, "A", "assign_strategy")
    assert assigned[0]["t"] == pytest.approx(call_start)
    assert (assigned[0]["strategy"], assigned[0]["context_tokens"]) == ("preserve", 99)
    assert _events(events, "H", "finish")[0]["t"] == pytest.approx(h_end)
    crossing = call_start + 0.2 - _slow_t(99)
    assert (h_end < crossing) is switches  # the scenario is on the intended side
    reconsidered = [a for a in assigned if a["reason"] == "reconsidered"]
    if switches:
        assert len(reconsidered) == 1
        assert reconsidered[0]["strategy"] == "discard"
        assert reconsidered[0]["t"] == pytest.approx(h_end)  # the first iteration with K = 0
        assert reconsidered[0]["api_s"] == pytest.approx(call_start + 0.2 - h_end)
        resume = _events(events, "A", "resume")[0]["where"]
        assert resume == "waiting"
        assert _events(events, "A", "admit")[-1]["prefill_tokens"] == 99 + 1 + 5  # recomputed
        assert next(r for r in result.records if r.request_id == "A").strategies == ("discard",)  # what ran
    else:
        assert reconsidered == []
        assert next(r for r in result.records if r.request_id == "A").strategies == ("preserve",)
        assert _events(events, "A", "resume")[0]["where"] == "device"


# --- 8. MARS and SJF decide ahead from the predictions, not the truth -------------------------


class _FixedLength:
    """Predicts 5 tokens for every segment."""

    name = "fixed-5"

    def predict(self, request, segment_index):
        return 5


class _FixedApi:
    """Predicts every call at 1 ms returning 3 tokens."""

    name = "fixed-1ms"

    def estimate(self, request, segment_index):
        return ApiEstimate(0.001, 3) if request.segments[segment_index].api else ApiEstimate(0.0, 0)

    def observe(self, api_type, duration_s, return_tokens):
        pass

    def declare(self, api_type, duration_s, return_tokens):
        pass


_WRONG = SegmentPredictor(_FixedLength(), _FixedApi())


@pytest.mark.parametrize("policy_name", ["mars", "sjf"])
def test_ahead_of_time_strategy_follows_the_predictions(policy_name):
    # The truth: 40 tokens, then a 30 s call: C = 90, and a long call would be swapped
    # (Swap 2·90/20000·90 = 0.81 < Discard 0.0145·90 = 1.31 < Preserve 2700).
    # The prediction: 5 tokens and a 1 ms call: C = 55, Preserve 0.055 < Swap 0.30 < Discard 0.70.
    request = two_segment("r", 0.0, 50, 40, 30.0, 4, 10)
    policy = make_policy(policy_name, COST, predictor=_WRONG)
    progress = RequestProgress(request, order_s=0.0)
    policy.start_segment(progress, LOAD)
    assignment = progress.assignments[-1]
    assert (assignment.reason, assignment.context_tokens, assignment.api_s) == ("ahead", 55, 0.001)
    assert assignment.strategy is Strategy.PRESERVE
    # In a run the call keeps what was fixed ahead, although it turns out long.
    _, events = _run([request], make_policy(policy_name, COST, predictor=_WRONG), small_profile())
    assigned = _events(events, "r", "assign_strategy")
    assert [(a["reason"], a["context_tokens"], a["api_s"], a["strategy"]) for a in assigned] == [
        ("ahead", 55, 0.001, "preserve")
    ]
    api_start = _events(events, "r", "api_start")[0]
    assert api_start["strategy"] == "preserve" and api_start["context_tokens"] == 50 + 40 - 1


def test_ahead_of_time_strategy_with_an_oracle_uses_the_truth():
    request = two_segment("r", 0.0, 50, 40, 30.0, 4, 10)
    progress = RequestProgress(request, order_s=0.0)
    make_policy("mars", COST).start_segment(progress, LOAD)
    assignment = progress.assignments[-1]
    assert (assignment.context_tokens, assignment.api_s, assignment.strategy) == (90, 30.0, Strategy.SWAP)


def test_infercept_reconsiders_every_preserved_call_and_traces_the_new_assignment():
    """A preserved call that stays preserved does not stop the others' reconsideration in the same
    step, and the assign_strategy event traced is the reconsidered assignment, the request's last."""
    from marsched.policy.progress import StrategyAssignment
    from marsched.sim.engine import Phase, SimRequest
    from marsched.sim.memory import blocks_for
    policy = make_policy("infercept", _SLOW)
    trace = Recorder()
    sim = Simulator([], Profile("slow", "test engine, 1 ms per token", 1.0, 64, 0, 16, _SLOW), policy, trace=trace)
    load = sim.load()
    # keep: 5 tokens, 10 ms of call left: preserving (0.05) beats discarding (0.015·5 = 0.075).
    # switch: in its second call, 99 tokens, 0.2 s left: discarding (0.109·99 = 10.8) beats preserving (19.8).
    keep = build_request("keep", 5, [(1, ApiCall(ApiType.OTHER, 0.01, 1)), (1, None)], 0.0)
    switch = build_request("switch", 99, [(1, ApiCall(ApiType.OTHER, 0.2, 1)), (1, ApiCall(ApiType.OTHER, 0.2, 1)),
                                           (1, None)], 0.0)
    for request, segment in ((keep, 0), (switch, 1)):
        progress = RequestProgress(request, order_s=0.0)
        progress.segment_index = segment
        policy.start_segment(progress, load)
        for index in range(segment + 1):
            progress.assign(StrategyAssignment(index, Strategy.PRESERVE, 0.0, request.prompt_tokens, 0.2, "at-call"))
        progress.computed_tokens = request.prompt_tokens
        progress.api_started_s = 0.0
        sim_request = SimRequest(progress, phase=Phase.PAUSED, device_blocks=blocks_for(request.prompt_tokens, 16),
                                 strategies=["preserve"] * (segment + 1))
        sim.device.allocate(sim_request.device_blocks)
        sim.live[request.request_id] = sim_request
        sim.paused_preserved[request.request_id] = sim_request
    sim._reconsider_paused()
    assert list(sim.paused_preserved) == ["keep"]
    switched = sim.live["switch"]
    assert switched.strategies == ["preserve", "discard"] and switched.device_blocks == 0
    traced = _events(trace.events, "switch", "assign_strategy")
    assert [(e["strategy"], e["reason"]) for e in traced] == [("discard", "reconsidered")]

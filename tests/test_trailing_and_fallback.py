"""Trailing calls, the host-full fallback, and the small pieces of state the engines rely on.

Hand-sized runs on the `simhelpers` test engine (16-token blocks, t(n) = 10 ms + 0.05 ms·n,
a 128-token budget); the expected numbers are worked out in the comments.
"""

from __future__ import annotations

import pytest

from marsched.policy import CostModel, WaitingQueue, make_policy
from marsched.policy.load import EngineLoad
from marsched.policy.progress import RequestProgress
from marsched.policy.strategy import Strategy
from marsched.sim.engine import Simulator
from marsched.workload import ApiCall, ApiType, build_request
from simhelpers import COST, single, small_profile, two_segment
from test_engine_semantics import Recorder, _events, t

LOAD = EngineLoad(now_s=0.0, running_kv_tokens=0, iteration_s=0.01, host_free_tokens=10**9)


def _trailing(rid="T", arrival=0.0, last_call_s=1.0):
    # 40-token prompt, 10 tokens, a 0.5 s call returning 5, 8 tokens, then a trailing call returning 7.
    return build_request(rid, 40, [(10, ApiCall(ApiType.OTHER, 0.5, 5)), (8, ApiCall(ApiType.OTHER, last_call_s, 7))],
                         arrival)


@pytest.mark.parametrize("policy_name", ["mars", "infercept", "vllm", "preserve"])
def test_a_trailing_call_frees_the_kv_and_the_request_ends_when_it_returns(policy_name):
    during_call = []

    def watch(event):
        if event["event"] == "api_start" and event["segment"] == 1:
            during_call.append(sim.device.used)

    trace = Recorder(watch)
    sim = Simulator([_trailing()], small_profile(), make_policy(policy_name, COST), trace=trace)
    result = sim.run()
    events = trace.events
    last_call = _events(events, "T", "api_start")[1]
    # Nothing is computed after the last call, so nothing is kept for it.
    assert last_call["strategy"] is None and during_call == [0]
    assert last_call["context_tokens"] == 40 + 10 + 5 + 8
    finish = _events(events, "T", "finish")[0]
    assert finish["t"] == pytest.approx(last_call["t"] + 1.0)
    assert not [e for e in events if e["event"] == "admit" and e["segment"] == 2]
    record = result.records[0]
    assert (record.output_tokens, record.api_return_tokens, record.api_time_s) == (18, 12, 1.5)
    assert sim.device.used == 0 and sim.host.used == 0


def test_a_trailing_call_gets_no_strategy_and_no_call_area():
    mars = make_policy("mars", COST)
    trailing = RequestProgress(_trailing(), order_s=0.0)
    without = RequestProgress(build_request("N", 40, [(10, ApiCall(ApiType.OTHER, 0.5, 5)), (8, None)]), order_s=0.0)
    for progress in (trailing, without):
        mars.start_segment(progress, LOAD)
    # A 1 s trailing call, or a 100 s one, adds nothing: its KV is freed at the call.
    assert mars.memory_time(trailing, LOAD) == pytest.approx(mars.memory_time(without, LOAD))
    long_tail = RequestProgress(_trailing(last_call_s=100.0), order_s=0.0)
    mars.start_segment(long_tail, LOAD)
    assert mars.memory_time(long_tail, LOAD) == pytest.approx(mars.memory_time(without, LOAD))
    trailing.segment_index = 1
    mars.start_segment(trailing, LOAD)
    assert trailing.strategy is None and len(trailing.assignments) == 1  # segment 0's only


def test_the_last_request_ending_with_a_call_ends_the_run():
    result = Simulator([_trailing()], small_profile(), make_policy("infercept", COST)).run()
    assert len(result.records) == 1 and result.end_s == pytest.approx(result.records[0].finish_s)


# --- swap with no room on the host ------------------------------------------------------------


def _swap_run(policy_name, api_s):
    request = two_segment("S", 0.0, 100, 5, api_s, 2, 5)
    trace = Recorder()
    sim = Simulator([request], small_profile(host_blocks=0), make_policy(policy_name, COST), trace=trace)
    result = sim.run()
    return result.records[0], _events(trace.events, "S", "assign_strategy")


@pytest.mark.parametrize("api_s, expected", [(10.0, "discard"), (0.0001, "preserve")])
def test_swap_with_a_full_host_falls_back_to_the_cheaper_of_preserve_and_discard(api_s, expected):
    # Context at the call: 104 tokens. Preserve costs 104·T; Discard Tfwd(104)·104 = 0.0152·104 ≈ 1.58.
    record, assignments = _swap_run("swap", api_s)
    assert record.strategies == (expected,)
    fallback = assignments[-1]
    assert (fallback["reason"], fallback["strategy"], fallback["context_tokens"]) == ("host-full", expected, 104)
    assert fallback["api_s"] == api_s  # the fixed rule's prediction: the call's (oracle) duration


def test_infercept_with_no_host_room_decides_between_preserve_and_discard_at_the_call():
    # INFERCEPT would swap a 10 s call (waste 2·Tswap(104)·104 ≈ 1.08 < discard 1.58); seeing no host
    # room at the call, it picks discard there, from the actual context and the whole call ahead.
    record, assignments = _swap_run("infercept", 10.0)
    assert record.strategies == ("discard",)
    assert (assignments[-1]["reason"], assignments[-1]["context_tokens"]) == ("at-call", 104)
    assert assignments[-1]["api_s"] == pytest.approx(10.0)


# --- small pieces of state ----------------------------------------------------------------------


def test_push_back_takes_back_only_the_request_popped_last():
    mars = make_policy("mars", COST, starvation="iterations", starvation_threshold=100)
    queue = WaitingQueue(mars)
    small, large = (RequestProgress(single(rid, 0.0, n, n), order_s=0.0) for rid, n in (("small", 10), ("large", 500)))
    for progress in (small, large):
        mars.start_segment(progress, LOAD)
        queue.push(progress, LOAD, iteration=0)
    with pytest.raises(ValueError, match="push_back takes back only the request popped last"):
        queue.push_back(large)
    popped = queue.pop(7, 0.0)
    assert popped is small and small.waited_iterations == 7 and "small" not in queue
    queue.push_back(small)
    assert small.waited_iterations == 0 and "small" in queue and len(queue) == 2
    assert queue.starvation_counter("small", 9, 0.0) == 9  # its counter kept running while it was out
    assert [p.request_id for p in queue.ordered()] == ["small", "large"]
    with pytest.raises(ValueError):
        queue.push_back(small)  # only once
    with pytest.raises(ValueError, match="already waiting"):
        queue.push(small, LOAD, iteration=9)


def test_kv_outlook_follows_the_prediction_and_the_strategy():
    mars = make_policy("mars", COST)
    progress = RequestProgress(two_segment("r", 0.0, 100, 30, 0.0001, 2, 5), order_s=0.0)
    mars.start_segment(progress, LOAD)
    assert progress.strategy is Strategy.PRESERVE  # a 0.1 ms call: keeping 130 tokens costs almost nothing
    progress.generated = 12
    outlook = mars.kv_outlook(progress)
    assert (outlook.tokens, outlook.decode_left, outlook.held_after) == (100, 18, True)
    progress.generated = 40  # past the prediction: one more iteration at least
    assert mars.kv_outlook(progress).decode_left == 1
    progress.segment_index, progress.generated = 1, 0
    mars.start_segment(progress, LOAD)
    assert mars.kv_outlook(progress).held_after is False  # the last segment frees its KV at the end


@pytest.mark.parametrize("kwargs, message", [
    (dict(token_budget=0), "token budget must be >= 1"),
    (dict(swap_tokens_per_s=0.0), "swap bandwidth must be > 0"),
])
def test_cost_model_refuses_impossible_engines(kwargs, message):
    values = dict(seconds_per_token=1e-5, seconds_per_iteration=0.01, token_budget=128, swap_tokens_per_s=1e4)
    values.update(kwargs)
    with pytest.raises(ValueError, match=message):
        CostModel(**values)


def test_cost_model_times():
    assert COST.swap_time(-5) == 0 and COST.swap_time(20_000) == pytest.approx(1.0)
    assert COST.recompute_time(0) == 0
    assert COST.recompute_time(300) == pytest.approx(2 * t(128) + t(44))
    assert COST.full_iteration_s == pytest.approx(t(128))


def test_check_invariants_catches_accounting_errors():
    def corrupt_at_step(n, corrupt, message):
        sim = Simulator([single("r", 0.0, 40, 50)], small_profile(), make_policy("infercept", COST))
        steps = []

        def hook(s):
            steps.append(1)
            s.check_invariants()  # consistent until corrupted
            if len(steps) == n:
                corrupt(s)
                s.check_invariants()

        sim.on_step = hook
        with pytest.raises(AssertionError, match=message):
            sim.run()

    def pool_drift(s):
        s.device.used += 1

    def overfull_blocks(s):
        live = next(iter(s.live.values()))
        live.progress.computed_tokens = live.device_blocks * 16 + 1

    def over_capacity(s):
        s.device.used = s.device.capacity + 1
        next(iter(s.live.values())).device_blocks += s.device.capacity + 1 - sum(
            r.device_blocks for r in s.live.values())

    def host_drift(s):
        s.host.used += 1

    corrupt_at_step(1, pool_drift, "block accounting: device")
    corrupt_at_step(1, host_drift, "host 1 vs 0")
    corrupt_at_step(1, overfull_blocks, "r: .* computed tokens in .* blocks")
    corrupt_at_step(1, over_capacity, "^block pool outside its capacity$")


def test_during_a_transfer_only_the_device_copy_holds_the_computed_tokens():
    """A request moving to or from the host holds blocks in both pools, but what it computed must
    fit in its device blocks alone: one token past them is an accounting error even though the
    host copy would hold it."""
    from marsched.sim.profile import load_profile, scale_kv_capacity
    from marsched.sim.select import make_simulator
    from marsched.workload.arrivals import poisson_arrivals
    from marsched.workload.loader import load_trace

    profile = scale_kv_capacity(load_profile("gptj-6b-a100"), 0.05)
    moving = []

    def corrupt_a_moving_request(s):
        s.check_invariants()  # consistent until corrupted, and again once put back
        for r in s.live.values():
            if not moving and r.transfer is not None and r.device_blocks and r.host_blocks:
                moving.append(r.rid)
                computed, r.progress.computed_tokens = r.progress.computed_tokens, r.device_blocks * s.block_tokens + 1
                with pytest.raises(AssertionError, match=f"^{r.rid}: .* computed tokens in {r.device_blocks} blocks$"):
                    s.check_invariants()
                r.progress.computed_tokens = computed

    sim = make_simulator(poisson_arrivals(load_trace("single"), 2, 60, 1), profile,
                         make_policy("infercept", profile.cost), on_step=corrupt_a_moving_request)
    sim.run()
    assert moving


@pytest.mark.parametrize("method, blocks, message", [
    ("allocate", -1, "device pool: cannot allocate -1 blocks with 4 free"),
    ("allocate", 5, "device pool: cannot allocate 5 blocks with 4 free"),
    ("release", -1, "device pool: cannot release -1 blocks with 0 in use"),
    ("release", 1, "device pool: cannot release 1 blocks with 0 in use"),
])
def test_block_pool_refuses_impossible_moves(method, blocks, message):
    from marsched.sim.memory import BlockPool

    pool = BlockPool("device", 4)
    with pytest.raises(RuntimeError) as error:
        getattr(pool, method)(blocks)
    assert str(error.value) == message
    pool.allocate(0)
    pool.allocate(4)
    pool.release(4)
    assert pool.used == 0


def test_ranking_time_per_iteration_follows_the_engine():
    # τ starts at one decode iteration, t(1), and moves 1% of the way to each iteration's time.
    sim = Simulator([single("r", 0.0, 100, 3)], small_profile(), make_policy("mars", COST))
    assert sim.load().iteration_s == pytest.approx(t(1))
    taus = []
    sim.on_step = lambda s: taus.append(s.load().iteration_s)
    sim.run()
    after_prefill = t(1) + (t(100) - t(1)) * 0.01
    assert taus[0] == pytest.approx(after_prefill)
    # The two decode iterations run together: 1 − 0.99² of the way to t(1).
    assert taus[1] == pytest.approx(after_prefill + (t(1) - after_prefill) * (1 - 0.99**2))


@pytest.mark.parametrize("host_blocks, expected", [(7, "swap"), (6, "discard")])
def test_swap_takes_a_host_exactly_as_large_as_the_context(host_blocks, expected):
    # 104 tokens of context at the call fill 7 blocks of 16: a host of exactly 7 blocks takes them.
    request = two_segment("S", 0.0, 100, 5, 10.0, 2, 5)
    result = Simulator([request], small_profile(host_blocks=host_blocks), make_policy("swap", COST)).run()
    assert result.records[0].strategies == (expected,)


def test_each_host_full_fallback_is_traced_with_its_own_call():
    request = build_request("S", 100, [(5, ApiCall(ApiType.OTHER, 10.0, 2)), (5, ApiCall(ApiType.OTHER, 10.0, 2)),
                                       (5, None)], 0.0)
    trace = Recorder()
    Simulator([request], small_profile(host_blocks=0), make_policy("swap", COST), trace=trace).run()
    fallbacks = [e for e in _events(trace.events, "S", "assign_strategy") if e["reason"] == "host-full"]
    assert [e["segment"] for e in fallbacks] == [0, 1]
    assert fallbacks[0]["context_tokens"] == 104 and fallbacks[1]["context_tokens"] > 104


def test_calls_that_end_at_the_same_instant_return_in_the_order_they_started():
    # A and B run in lockstep, so both calls of each end at exactly the same time as the other's.
    requests = [build_request(rid, 20, [(5, ApiCall(ApiType.OTHER, 0.5, 2)), (5, ApiCall(ApiType.OTHER, 0.5, 0))],
                              0.0) for rid in ("A", "B")]
    trace = Recorder()
    Simulator(requests, small_profile(), make_policy("preserve", COST), trace=trace).run()
    starts = [(e["rid"], e["segment"]) for e in trace.events if e["event"] == "api_start"]
    ends = [(e["rid"], e["segment"]) for e in trace.events if e["event"] == "api_end"]
    assert starts == [("A", 0), ("B", 0), ("A", 1), ("B", 1)]
    assert ends == starts
    end_times = [e["t"] for e in trace.events if e["event"] == "api_end"]
    assert end_times[0] == end_times[1] and end_times[2] == end_times[3]

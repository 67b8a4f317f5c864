"""When each policy fixes a call's strategy, and whether it keeps it."""

from marsched.metrics import TraceFile, read_trace
from marsched.policy import Strategy, WaitingQueue, make_policy
from marsched.policy.load import EngineLoad
from marsched.policy.progress import RequestProgress
from marsched.policy.waste import CallCosts
from marsched.sim.engine import Simulator
from marsched.workload import build_request
from simhelpers import COST, single, small_profile, two_segment

LOAD = EngineLoad(now_s=0.0, running_kv_tokens=0, iteration_s=0.01, host_free_tokens=10**9)


def _run(requests, policy_name, profile, tmp_path, **policy_args):
    path = tmp_path / f"{policy_name}.jsonl"
    policy = make_policy(policy_name, COST, **policy_args)
    trace = TraceFile(path)
    result = Simulator(requests, profile, policy, trace=trace).run()
    trace.close()
    return result, read_trace(path)


def _events(trace, rid, kind):
    return [e for e in trace if e.get("rid") == rid and e["event"] == kind]


def _pressure_workload():
    # One two-call request among single-segment requests that fill the device: it gets preempted.
    requests = [two_segment("aug", 0.0, 100, 60, 2.0, 10, 40)]
    requests += [single(f"s{i}", 0.01 * i, 120, 80) for i in range(1, 12)]
    return requests


def test_mars_assigns_before_first_token_and_keeps_through_preemption_and_return(tmp_path):
    profile = small_profile(device_blocks=24, host_blocks=64)
    # Greedy admission: predicted-peak admission would avoid the preemption this test needs.
    result, trace = _run(_pressure_workload(), "mars", profile, tmp_path, admission="greedy")
    assigned = _events(trace, "aug", "assign_strategy")
    first_admit = _events(trace, "aug", "admit")[0]
    api_start = _events(trace, "aug", "api_start")[0]
    assert assigned[0]["reason"] == "ahead"
    assert assigned[0]["t"] <= first_admit["t"]  # fixed before the segment's first token
    preempts = [e for e in trace if e["event"] == "preempt"]
    assert preempts, "the workload must cause preemptions for this test to mean anything"
    aug_preempted = _events(trace, "aug", "preempt")
    assert aug_preempted and aug_preempted[0]["t"] < api_start["t"]
    # Kept through the preemption and re-queueing: the call runs under the strategy fixed at arrival.
    assert aug_preempted[0]["strategy"] == assigned[0]["strategy"]
    assert api_start["strategy"] == assigned[0]["strategy"]
    assert [a["reason"] for a in assigned if a["segment"] == 0] == ["ahead"]
    record = next(r for r in result.records if r.request_id == "aug")
    assert record.strategies == (assigned[0]["strategy"],)


def test_mars_decides_next_segment_at_its_start_not_at_its_call(tmp_path):
    request = two_segment("a", 0.0, 50, 20, 1.0, 5, 10)
    call = request.segments[0].api
    three = build_request("b", 50, [(20, call), (15, call), (5, None)], 0.0)
    _, trace = _run([request, three], "mars", small_profile(), tmp_path)
    assignment = next(e for e in _events(trace, "b", "assign_strategy") if e["segment"] == 1)
    resume = next(e for e in _events(trace, "b", "resume") if e["segment"] == 1)
    assert assignment["t"] == resume["t"]  # at the previous call's return
    api = next(e for e in _events(trace, "b", "api_start") if e["segment"] == 1)
    assert api["t"] > assignment["t"]


def test_infercept_decides_at_the_call(tmp_path):
    _, trace = _run([two_segment("a", 0.0, 100, 30, 5.0, 10, 10)], "infercept", small_profile(), tmp_path)
    assigned = _events(trace, "a", "assign_strategy")
    api_start = _events(trace, "a", "api_start")[0]
    assert assigned[0]["reason"] == "at-call"
    assert assigned[0]["t"] == api_start["t"]
    # From the actual context at the call: prompt + generated tokens (the last one not yet computed).
    assert assigned[0]["context_tokens"] == 100 + 30 - 1


def test_infercept_reconsiders_a_preserved_call():
    policy = make_policy("infercept", COST)
    request = two_segment("a", 0.0, 400, 10, 0.5, 4, 4)
    progress = RequestProgress(request, order_s=0.0, computed_tokens=409, context_tokens=410, generated=10)
    policy.start_segment(progress, LOAD)
    progress.api_started_s = 0.0
    busy = EngineLoad(now_s=0.0, running_kv_tokens=500_000, iteration_s=0.01, host_free_tokens=0)
    assert policy.strategy_at_call(progress, busy) is Strategy.PRESERVE
    # Nothing runs any more and the call still has long to go: recomputing later is now cheaper.
    idle = EngineLoad(now_s=0.01, running_kv_tokens=0, iteration_s=0.01, host_free_tokens=0)
    assert policy.reconsider(progress, idle) is Strategy.DISCARD
    assert progress.assignments[-1].reason == "reconsidered"


def test_vllm_requeues_at_the_tail_after_a_call(tmp_path):
    requests = [two_segment("a", 0.0, 50, 10, 1.0, 5, 10), single("late", 0.5, 50, 10)]
    _, trace = _run(requests, "vllm", small_profile(), tmp_path)
    assert _events(trace, "a", "api_start")[0]["strategy"] == "discard"
    assert _events(trace, "a", "resume")[0]["where"] == "waiting"


def test_starvation_counter_changes_the_order():
    policy = make_policy("mars", COST, starvation="iterations", starvation_threshold=5)
    queue = WaitingQueue(policy)
    long = RequestProgress(single("long", 0.0, 1000, 500), order_s=0.0)
    policy.start_segment(long, LOAD)
    queue.push(long, LOAD, iteration=0)
    for i in range(1, 5):
        short = RequestProgress(single(f"s{i}", 0.0, 10, 5), order_s=0.0)
        policy.start_segment(short, LOAD)
        queue.push(short, LOAD, iteration=i)
    assert next(queue.ordered()).request_id != "long"
    assert queue.promote_starving(4, 0.0) == []
    assert queue.starvation_counter("long", 4, 0.0) == 4
    assert [p.request_id for p in queue.promote_starving(5, 0.0)] == ["long"]
    assert queue.pop(10, 0.0).request_id == "long"  # ahead of every lower key
    assert long.promoted


def test_no_starvation_prevention_keeps_key_order():
    policy = make_policy("mars", COST, starvation_threshold=None)
    queue = WaitingQueue(policy)
    long = RequestProgress(single("long", 0.0, 1000, 500), order_s=0.0)
    short = RequestProgress(single("short", 0.0, 10, 5), order_s=0.0)
    for progress in (long, short):
        policy.start_segment(progress, LOAD)
        queue.push(progress, LOAD, iteration=0)
    assert queue.promote_starving(10_000, 0.0) == []
    assert queue.pop(10, 0.0).request_id == "short"


def _three_segment(rid, second_call_s):
    from marsched.workload import ApiCall, ApiType
    # Context at the second call: 300 + 50 + 50 + 200 = 600 tokens.
    return build_request(rid, 300, [(50, ApiCall(ApiType.OTHER, 1.0, 50)),
                                    (200, ApiCall(ApiType.OTHER, second_call_s, 10)), (20, None)], 0.0)


def test_a_later_calls_strategy_in_the_key_is_chosen_at_that_calls_context():
    """The key's outlook picks a later call's strategy by waste at the context the request will have
    at that call (its context at the segment start plus the segment's output), not before it."""
    policy = make_policy("mars", COST)
    progress = RequestProgress(_three_segment("r", 0.05), order_s=0.0)
    policy.start_segment(progress, LOAD)
    later = policy.outlook(progress, LOAD)[1]
    assert later.context_tokens == 400
    # At 600 tokens and 0.05 s preserving is the cheapest; at 200 tokens swapping would be.
    assert later.strategy is Strategy.PRESERVE
    assert policy._later_strategy(CallCosts.of(600, 0.05, COST), LOAD) is Strategy.PRESERVE
    assert policy._later_strategy(CallCosts.of(200, 0.05, COST), LOAD) is Strategy.SWAP
    # memory_time is the key's value and uses the load for that choice.
    assert policy.memory_time(progress, LOAD) == policy.queue_key(progress, LOAD)


def test_the_current_segment_has_at_least_one_token_left_to_decode():
    policy = make_policy("mars", COST)
    progress = RequestProgress(single("r", 0.0, 10, 5), order_s=0.0)
    policy.start_segment(progress, LOAD)
    progress.generated = 4
    assert policy.outlook(progress, LOAD)[0].decode_tokens == 1
    progress.generated = 9  # past the prediction: still one
    assert policy.outlook(progress, LOAD)[0].decode_tokens == 1


def test_only_keys_that_pick_later_strategies_by_waste_follow_the_running_kv():
    for name, follows in (("mars", True), ("preserve", False), ("vllm", False)):
        policy = make_policy(name, COST)
        progress = RequestProgress(_three_segment("r", 0.05), order_s=0.0)
        policy.start_segment(progress, LOAD)
        assert policy._later_strategies_follow_load(progress) is follows, name


def test_admitting_a_promoted_request_clears_its_promotion():
    policy = make_policy("mars", COST, starvation="iterations", starvation_threshold=3)
    progress = RequestProgress(single("r", 0.0, 10, 5), order_s=0.0)
    progress.promoted = True
    policy.protect(progress, iteration=7)
    assert progress.promoted is False
    assert policy.is_protected(progress, iteration=8)


def test_remaining_area_is_the_key_forms_value():
    import dataclasses

    from marsched.policy.ranking import remaining_area, remaining_area_form
    policy = make_policy("mars", COST)
    progress = RequestProgress(_three_segment("r", 0.05), order_s=0.0)
    policy.start_segment(progress, LOAD)
    outlook = policy.outlook(progress, LOAD)
    for iteration_s in (0.01, 0.05):
        expected = remaining_area_form(outlook, COST, policy.terms).at(iteration_s)
        assert remaining_area(outlook, iteration_s, COST, policy.terms) == expected
        assert expected == policy.queue_key(progress, dataclasses.replace(LOAD, iteration_s=iteration_s))

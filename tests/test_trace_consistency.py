"""Every event of a simulator trace says what happened, in the fields `metrics/trace.py` documents.

Runs of every policy over a small mixed workload (calls short and long, preserved, swapped and
discarded, preemptions, promotions, a trailing call), checked event by event against the
requests, the engine's state at the moment of the event, and the other events.
"""

from __future__ import annotations

import pytest

from marsched.policy import POLICY_NAMES, make_policy
from marsched.policy.policy import StrategyRule
from marsched.sim.memory import blocks_for
from marsched.workload import ApiCall, ApiType, build_request
from simhelpers import COST, single, small_profile
from test_engine_semantics import _run

COMMON = {"iteration", "kv_device_blocks", "kv_host_blocks"}
REQUEST = COMMON | {"segment", "queue"}
FIELDS = {
    "run": COMMON | {"schema_version", "engine", "policy", "device_blocks", "host_blocks", "block_tokens"},
    "end": COMMON | {"requests"},
    "arrive": REQUEST | {"arrival_s", "prompt_tokens"},  # not its segments: the arrival does not tell
    "predict": REQUEST | {"output_tokens", "api_s", "return_tokens", "predictor", "source"},
    "assign_strategy": REQUEST | {"strategy", "reason", "context_tokens", "api_s"},
    "admit": REQUEST | {"prefill_tokens", "wait_s", "score", "promoted", "counter", "key_basis", "predicted_output_tokens",
                        "predicted_api_s"},
    "schedule": COMMON | {"iterations", "batch", "tokens", "context_tokens", "dt_s", "span_s", "free_blocks", "host_free_blocks", "waiting",
                          "next_score"},
    "preempt": REQUEST | {"strategy", "freed_blocks"},
    "api_start": REQUEST | {"strategy", "context_tokens", "duration_s"},
    "swap_out": REQUEST | {"blocks"},
    "swap_in": REQUEST | {"blocks"},
    "api_end": REQUEST | {"return_tokens"},
    "resume": REQUEST | {"where"},
    "promote": REQUEST | {"counter"},
    "finish": REQUEST | {"e2e_s", "ttft_s", "status", "strategies", "preemptions", "segments"},
}
# A trailing call; a segment without a call; an empty queue.
NULLABLE = {("api_start", "strategy"), ("preempt", "strategy"), ("schedule", "next_score"),
            ("admit", "protected_until"), ("admit", "protected_segment")}


def _workload():
    call = lambda s, r: ApiCall(ApiType.OTHER, s, r)  # noqa: E731
    requests = [
        build_request("long-call", 120, [(30, call(2.0, 20)), (20, None)], 0.0),
        build_request("short-call", 60, [(10, call(0.0001, 4)), (15, call(0.3, 8)), (10, None)], 0.01),
        build_request("trailing", 50, [(12, call(0.2, 6)), (9, call(0.5, 3))], 0.02),
    ]
    requests += [single(f"s{i}", 0.03 + 0.02 * i, 70 + 5 * i, 25 + i) for i in range(8)]
    return requests


def _check(policy, profile):
    requests = {r.request_id: r for r in _workload()}
    state = {}  # rid -> what the events so far say about it
    iterations = [0]
    seen = []

    budgeted = policy.rule is StrategyRule.BUDGETED  # INFERCEPT's code: partial swaps within budgets

    def watch(sim, event):
        kind, rid = event["event"], event["rid"]
        fields = set(event) - {"event", "t", "rid"}
        moving = policy.starvation.moves
        # A threshold that moves with the FCFS wait is reported where promotions are decided.
        expected = FIELDS[kind] | ({"threshold"} if moving and kind in ("schedule", "promote") else set())
        if kind == "admit" and policy.starvation.enabled:  # the protection it leaves the request with
            expected |= {"protected_until", "protected_segment"}
        if kind == "preempt" and not budgeted:  # the request it made room for (INFERCEPT's code preempts by swap)
            expected |= {"requester"}
        assert fields == expected, event
        for name in fields:
            assert event[name] is not None or (kind, name) in NULLABLE, event
        seen.append(kind)
        assert event["iteration"] == sim.iteration
        assert (event["kv_device_blocks"], event["kv_host_blocks"]) == (sim.device.used, sim.host.used)
        if kind in ("run", "end"):
            assert rid is None
            return
        if rid is not None:
            assert event["segment"] == (sim.live[rid].progress.segment_index if rid in sim.live else event["segment"])
        if kind == "schedule":
            assert rid is None
            assert event["iteration"] == iterations[0] == sim.iteration
            head = sim.queue.head_key()
            if moving:
                assert event["threshold"] == sim.queue.threshold(sim.now)
            assert event["waiting"] == len(sim.queue) and event["next_score"] == head
            iterations[0] += event["iterations"]
            assert event["dt_s"] == pytest.approx(COST.iteration_time(event["tokens"], event["context_tokens"], event["batch"]))
            if budgeted:  # requests delayed, or only swapping blocks in, are running but not computing
                assert event["context_tokens"] <= sum(r.progress.computed_tokens for r in sim.running) + event["tokens"]
                assert event["batch"] <= event["tokens"] and event["batch"] <= len(sim.running)
            else:
                assert event["context_tokens"] == sum(r.progress.computed_tokens for r in sim.running) + event["tokens"]
                assert 1 <= event["batch"] <= event["tokens"]
            assert (event["free_blocks"], event["host_free_blocks"]) == (sim.device.free, sim.host.free)
            assert event["t"] == sim.now
            return
        request = requests[rid]
        s = state.setdefault(rid, {"segment": 0})
        live = sim.live.get(rid)
        if kind == "arrive":
            assert event["prompt_tokens"] == request.prompt_tokens
            assert event["arrival_s"] == request.arrival_s
            s.update(arrive=event["t"], queued=event["t"])
        elif kind == "assign_strategy":
            assert event["segment"] == s["segment"] == live.progress.segment_index
            assert event["strategy"] == live.progress.strategy.value
            segment = request.segments[event["segment"]]
            if event["reason"] == "ahead" and not policy.knows_future:  # predicted from the past: the context so far
                assert event["context_tokens"] > segment.context_tokens
            if event["reason"] == "ahead" and policy.knows_future:  # oracle predictions: the segment's own context and call
                assert (event["context_tokens"], event["api_s"]) == (segment.context_at_call, segment.api.duration_s)
        elif kind == "admit":
            assert event["segment"] == s["segment"]
            assert event["wait_s"] == pytest.approx(event["t"] - s["queued"])
            if budgeted:  # a swap-in computes once its last blocks are back, in the same iteration
                assert 0 <= event["prefill_tokens"] <= min(live.progress.pending_tokens, COST.token_budget)
            elif live.host_blocks:  # a swap-in: the KV comes back over the link, nothing is prefilled
                assert event["prefill_tokens"] == 0
            else:  # what the iteration's budget leaves of what is pending
                assert 0 < event["prefill_tokens"] <= min(live.progress.pending_tokens, COST.token_budget)
        elif kind == "preempt":
            # By recompute the blocks on both sides are freed; by a budgeted swap, what went to the host.
            assert event["segment"] == s["segment"]
            assert event["freed_blocks"] == live.device_blocks + live.host_blocks > 0
            assert event["strategy"] == (live.progress.strategy.value if live.progress.strategy else None)
            s["queued"] = event["t"]
        elif kind == "api_start":
            segment = request.segments[event["segment"]]
            assert event["segment"] == s["segment"] and event["duration_s"] == segment.api.duration_s
            trailing = event["segment"] == len(request.segments) - 1
            # The last sampled token is not computed yet, except that a trailing call keeps nothing.
            assert event["context_tokens"] == segment.context_at_call - (0 if trailing else 1)
            assert (event["strategy"] is None) == trailing
            s.update(call_t=event["t"], call_blocks=blocks_for(segment.context_at_call - 1, 16), strategy=event["strategy"])
        elif kind == "swap_out" and budgeted:  # blocks from the tail, a budget's worth at a time
            assert 0 < event["blocks"] <= live.host_blocks
        elif kind == "swap_in" and budgeted:
            assert 0 < event["blocks"] <= live.device_blocks
        elif kind == "swap_out":
            assert event["blocks"] == s["call_blocks"]
            s["swapped_blocks"] = event["blocks"]
        elif kind == "swap_in":
            assert event["blocks"] == s["swapped_blocks"]
        elif kind == "api_end":
            segment = request.segments[s["segment"]]
            assert event["segment"] == s["segment"] and event["return_tokens"] == segment.api.return_tokens
            assert event["t"] >= s["call_t"] + segment.api.duration_s - 1e-9
            s["segment"] += 1
        elif kind == "resume":
            assert event["segment"] == s["segment"]
            expected = {"device": live.device_blocks > 0, "host": live.host_blocks > 0 and not live.device_blocks,
                        "waiting": not live.device_blocks and not live.host_blocks}
            assert expected[event["where"]], event
            if event["where"] != "device":
                s["queued"] = event["t"]
        elif kind == "promote":  # the counter reached the threshold (the queue takes a hair short as there)
            assert event["counter"] >= event.get("threshold", policy.starvation.threshold) - 1e-9
            assert event.get("threshold", policy.starvation.threshold) >= policy.starvation.threshold
        elif kind == "finish":
            record = next(r for r in sim.records if r.request_id == rid)
            assert (event["t"], event["e2e_s"], event["ttft_s"]) == (record.finish_s, record.e2e_s, record.ttft_s)
            assert event["segments"] == len(request.segments)
            # Arrivals are taken in at the next iteration boundary: the event is at most one iteration late.
            assert record.arrival_s == request.arrival_s <= s["arrive"] < request.arrival_s + COST.full_iteration_s

    sim, result, _ = _run(list(requests.values()), policy, profile, watch)
    assert len(result.records) == len(requests) and sim.device.used == 0 and sim.host.used == 0
    return seen


@pytest.mark.parametrize("policy_name", POLICY_NAMES)
def test_every_event_is_consistent_with_the_run(policy_name):
    seen = _check(make_policy(policy_name, COST), small_profile(device_blocks=20, host_blocks=64))
    assert {"arrive", "admit", "schedule", "api_start", "api_end", "resume", "finish"} <= set(seen)


def test_a_run_with_swaps_preemptions_and_promotions_is_consistent():
    policy = make_policy("mars", COST, starvation="iterations", starvation_threshold=5, admission="greedy")
    seen = set(_check(policy, small_profile(device_blocks=16, host_blocks=64)))
    assert {"swap_out", "swap_in", "preempt", "promote", "assign_strategy"} <= seen
    swap = _check(make_policy("swap", COST), small_profile(device_blocks=20, host_blocks=64))
    assert {"swap_out", "swap_in"} <= set(swap)


@pytest.mark.parametrize("rest", ["gittins", "mean"])
def test_a_run_that_knows_only_the_past_is_consistent(rest):
    from marsched.predict.online import OnlineLength, PastMeanApi
    from marsched.predict.segment import SegmentPredictor

    policy = make_policy("mars", COST, SegmentPredictor(OnlineLength(), PastMeanApi()), rest=rest)
    seen = _check(policy, small_profile(device_blocks=20, host_blocks=64))
    assert {"admit", "assign_strategy", "api_start", "finish"} <= set(seen)

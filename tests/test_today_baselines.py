"""Today's baselines worked by hand: Continuum's TTL (the paper's rule and the public 2 s rule),
Autellix's PLAS queues and anti-starvation ratio, and vLLM's CPU offloading loading a prefix
over the host link."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from marsched.policy.load import EngineLoad
from marsched.policy.plas import level_of, plas_key, LEVEL_SPAN_S
from marsched.policy.progress import RequestProgress
from marsched.policy.queue import WaitingQueue
from marsched.policy.registry import make_policy
from marsched.policy.strategy import Strategy
from marsched.policy.ttl import MAX_SAMPLES, FixedTtl, PaperTtl, best_ttl, memoryfulness
from marsched.sim.engine import Simulator
from marsched.sim.profile import load_profile
from marsched.workload.model import ApiCall, ApiType, build_request
from tests.test_engine_semantics import Recorder


# --- Continuum -----------------------------------------------------------------------------

def test_the_ttl_maximises_the_chance_of_a_hit_times_its_benefit_less_the_time_held() -> None:
    """Durations 0.5, 1, 3, 10 s and a benefit of 4 s: τ = 0.5 gives 1/4·4 − 0.5 = 0.5, τ = 1 gives
    2/4·4 − 1 = 1, τ = 3 gives 0, τ = 10 gives −6: the TTL is 1 s. With a benefit of 1 s every τ
    loses to not pinning (0)."""
    samples = [0.5, 1.0, 3.0, 10.0]
    assert best_ttl(samples, 4.0) == 1.0
    assert best_ttl(samples, 1.0) == 0.0
    assert best_ttl([2.0, 2.0, 2.0], 3.0) == 2.0  # the CDF at a repeated value counts all of them
    assert best_ttl([], 5.0) == 0.0
    assert best_ttl([0.0, 1.0, 1.0, 1.0], 4.0) == 1.0  # a 0 s sample: 1/4·4 at τ = 0 against 4 − 1 at τ = 1
    assert best_ttl([1.0, 10.0], 1.5) == 0.0  # τ = 1: 1/2·1.5 − 1 < 0
    assert best_ttl([1.0, 3.0], 4.0) == 1.0  # a tie, 1/2·4 − 1 = 4 − 3: the shorter τ
    assert best_ttl([1.0, 2.0], 2.0) == 0.0  # a tie with not pinning, 1/2·2 − 1 = 0: no pin


def test_memoryfulness_is_minus_the_correlation_of_turns_done_and_left() -> None:
    ttl = PaperTtl(lambda tokens: 0.0)
    assert ttl.eta == 1.0  # no program yet
    ttl.observe_program(3)  # (1,2), (2,1), (3,0): perfectly anti-correlated
    assert ttl.eta == pytest.approx(1.0)
    ttl.observe_program(1)  # (1,0)
    k, r = [1, 2, 3, 1], [2, 1, 0, 0]
    assert ttl.eta == pytest.approx(-np.corrcoef(k, r)[0, 1])
    assert memoryfulness(1, 1, 1, 1, 1, 1) == 1.0
    assert memoryfulness(2, 3, 1, 5, 1, 2) == pytest.approx(-1.0)  # (1, 0), (2, 1): two pairs are enough
    assert memoryfulness(2, 2, 1, 2, 1, 1) == 1.0  # (1, 0), (1, 1): k does not vary
    assert memoryfulness(2, 3, 4, 5, 8, 6) == 1.0  # (1, 2), (2, 2): N − k does not vary
    # Sums that rounding pushed past a correlation's range are held to it.
    assert memoryfulness(2, 0, 0, 1, 1, 5) == -1.0 and memoryfulness(2, 0, 0, 1, 1, -5) == 1.0


def test_the_paper_ttl_starts_cold_then_uses_the_tools_own_durations() -> None:
    """2 s until more than 100 calls were seen; then the global CDF until the tool itself has more
    than 100; the benefit is the prefill time of the context (no queueing delay observed yet)."""
    ttl = PaperTtl(lambda tokens: tokens / 1000)  # 1 ms a token to compute again
    for _ in range(100):
        ttl.observe_call("math", 1.0)
    assert ttl.ttl_s("math", 5000) == 2.0  # cold
    ttl.observe_call("qa", 30.0)
    # 101 samples: math has 100 (not more than 100), so the global CDF: τ = 1 s gives 100/101·5 − 1.
    assert ttl.ttl_s("math", 5000) == 1.0
    assert ttl.ttl_s("math", 500) == 0.0  # 100/101·0.5 − 1 < 0: not worth pinning
    for _ in range(101):
        ttl.observe_call("qa", 30.0)
    # qa has 102 samples of 30 s: its own CDF; pinning 30 s for a 5 s prefill does not pay.
    assert ttl.ttl_s("qa", 5000) == 0.0
    assert ttl.ttl_s("qa", 50_000) == 30.0
    ttl.observe_queue_delay(4.0)
    ttl.observe_program(2)
    # B = 4 s × η (1) + 0.5 s: the global CDF has 101 of 202 samples at 1 s: 101/202·4.5 − 1 > 0.
    assert ttl.ttl_s("math", 500) == 1.0


def test_the_paper_ttl_switches_to_a_tools_own_cdf_past_100_samples_and_keeps_its_newest() -> None:
    """Benefit 4 s: the global CDF of 101 samples of 1 s and 100 of 3 s gives τ = 1 s
    (101/201·4 − 1 > 4 − 3); the tool's own 3 s samples give 3 s."""
    ttl = PaperTtl(lambda tokens: tokens / 1000)
    for _ in range(101):
        ttl.observe_call("math", 1.0)
    for _ in range(100):
        ttl.observe_call("search", 3.0)
    assert ttl.ttl_s("search", 4000) == 1.0  # 100 samples: not more than 100, so the global CDF
    assert ttl.ttl_s("never-seen", 4000) == 1.0  # a tool never seen: the global CDF
    ttl.observe_call("search", 3.0)
    assert ttl.ttl_s("search", 4000) == 3.0
    ttl.observe_call("fast", -1.0)  # a clock that went back: 0 s
    ttl.observe_call("fast", 0.25)
    assert sorted(ttl._by_tool["fast"]) == [0.0, 0.25]
    for _ in range(MAX_SAMPLES):  # the window keeps the newest: 1 s samples push the 3 s ones out
        ttl.observe_call("search", 1.0)
    for _ in range(MAX_SAMPLES):
        ttl.observe_call("search", 30.0)
    assert ttl.ttl_s("search", 50_000) == 30.0  # only 30 s samples left: 50 − 30 > 0


def test_the_paper_ttls_queueing_benefit_is_weighted_by_memoryfulness() -> None:
    """B = T·η + C_prefill: T = 2 s, η = 0.45 (programs of 3 and 1 turns), no prefill cost:
    B = 0.91 s, so pinning 1 s does not pay (0.91 − 1 < 0); T / η would pay."""
    ttl = PaperTtl(lambda tokens: 0.0)
    for _ in range(101):
        ttl.observe_call("math", 1.0)
    ttl.observe_program(3)
    ttl.observe_program(1)
    assert ttl.eta == pytest.approx(0.4545, abs=1e-4)
    ttl.observe_queue_delay(2.0)
    assert ttl.ttl_s("math", 1000) == 0.0
    ttl.observe_queue_delay(2.6)  # T = 2.3 s: B = 1.045 s, so 1 s pays
    assert ttl.ttl_s("math", 1000) == 1.0


def test_the_public_rule_pins_two_seconds_after_a_fast_tool() -> None:
    ttl = FixedTtl()
    assert ttl.ttl_s("never-seen", 100) == 2.0
    ttl.observe_call("math", 1.0)
    ttl.observe_call("math", 2.0)
    assert ttl.ttl_s("math", 100) == 2.0  # mean 1.5 s
    ttl.observe_call("qa", 3.0)
    assert ttl.ttl_s("qa", 100) == 0.0
    ttl.observe_call("grep", 0.5)
    ttl.observe_call("grep", 3.0)
    assert ttl.ttl_s("grep", 100) == 2.0  # the mean of both, 1.75 s, not the last one's 3 s
    ttl.observe_call("edit", 2.0)
    assert ttl.ttl_s("edit", 100) == 2.0  # at most 2 s: a mean of exactly 2 s pins


def _one_call(rid: str, arrival_s: float, prompt: int, out: int, call_s: float, after: int = 4):
    return build_request(rid, prompt, [(out, ApiCall(ApiType.MATH, call_s, 4)), (after, None)], arrival_s)


def test_a_pin_ends_at_its_ttl_and_the_prefix_cache_serves_the_return() -> None:
    """continuum-public on a cold engine pins 2 s; a 10 s call outlives it: the KV is discarded at
    t_call + 2 s (trace: `ttl-expired`), and the return finds its full blocks in the prefix cache."""
    profile = load_profile("gptj-6b-a100")
    block = profile.block_tokens
    policy = make_policy("continuum-public", profile.cost, prefix_cache=True)
    trace = Recorder()
    Simulator([_one_call("a", 0.0, 4 * block, 8, 10.0)], profile, policy, trace=trace).run()
    start = next(e for e in trace.events if e["event"] == "api_start")
    assigned = [e for e in trace.events if e["event"] == "assign_strategy"]
    assert [(e["strategy"], e["reason"]) for e in assigned] == [("preserve", "ttl"), ("discard", "ttl-expired")]
    assert assigned[1]["t"] == pytest.approx(start["t"] + 2.0)
    admits = [e["prefill_tokens"] for e in trace.events if e["event"] == "admit"]
    assert admits == [4 * block, 12]  # the 8 generated tokens and the 4 returned


def test_pins_give_way_newest_program_first_when_memory_runs_short() -> None:
    """Two pinned programs hold the device; a newcomer that does not fit makes the newer one give
    up its pin (`pressure`); the older keeps its KV."""
    profile = replace(load_profile("gptj-6b-a100"), device_blocks=12)
    block = profile.block_tokens
    policy = make_policy("continuum-public", profile.cost, prefix_cache=True)
    trace = Recorder()
    requests = [_one_call("old", 0.0, 4 * block, 4, 1.5), _one_call("new", 0.001, 4 * block, 4, 1.5),
                build_request("big", 6 * block, [(2, None)], 0.5)]
    Simulator(requests, profile, policy, trace=trace).run()
    released = [(e["rid"], e["reason"]) for e in trace.events if e["event"] == "assign_strategy"
                and e["strategy"] == "discard"]
    assert released == [("new", "pressure")]


# --- Autellix ------------------------------------------------------------------------------

def test_plas_places_a_call_by_its_programs_service_and_moves_it_down_by_its_own() -> None:
    assert level_of(0, 0) == 0
    assert level_of(1, 0) == 0
    assert level_of(2, 0) == 1  # bounds 2, 4, 8, ...
    assert level_of(64, 0) == 6
    assert level_of(0, 1) == 1  # the first queue's quantum is 1 iteration
    assert level_of(1, 3) == 2  # 1 in queue 0, 2 in queue 1: queue 2
    assert level_of(100, 10_000) == 6  # the last queue keeps it
    assert plas_key(0, 0, 50.0) < plas_key(2, 0, 1.0)  # a lower queue goes first, whatever its arrival
    assert plas_key(2, 0, 1.0) == LEVEL_SPAN_S + 1.0


def _progress(rid: str, attained: int, order_s: float) -> RequestProgress:
    request = build_request(rid, 16, [(4, None)])
    progress = RequestProgress(request, order_s=order_s)
    progress.attained_iterations = attained
    progress.attained_before_segment = attained
    return progress


def test_autellix_promotes_a_call_whose_waiting_reaches_eight_times_its_service() -> None:
    """A program with 10 iterations of service waits 80 before it goes ahead; one with none waits
    8 (service counts as at least 1). Promoted, it goes ahead of a call in a higher queue."""
    cost = load_profile("gptj-6b-a100").cost
    policy = make_policy("autellix", cost)
    queue = WaitingQueue(policy)
    load = EngineLoad(0.0, 0, 0.02, 0)
    served, fresh = _progress("served", 10, 0.0), _progress("fresh", 0, 1.0)
    queue.push(served, load, 0)
    queue.push(fresh, load, 0)
    assert [p.request_id for p in queue.ordered()] == ["fresh", "served"]
    assert [p.request_id for p in queue.promote_starving(7, 0.0)] == []
    assert [p.request_id for p in queue.promote_starving(8, 0.0)] == ["fresh"]
    assert [p.request_id for p in queue.promote_starving(79, 0.0)] == []
    assert [p.request_id for p in queue.promote_starving(80, 0.0)] == ["served"]


# --- vLLM's CPU offloading -----------------------------------------------------------------

def test_an_offloaded_prefix_comes_back_over_the_link_before_the_request_computes() -> None:
    """A's 4-block prompt is stored on the host when it leaves at its call; B then takes every
    device block, evicting A's cached prefix. A's return loads the 4 blocks over the host link
    (4 blocks / the link's tokens per second) and computes only the rest."""
    base = load_profile("gptj-6b-a100")
    profile = replace(base, device_blocks=10)
    block = profile.block_tokens
    policy = make_policy("vllm-offload", profile.cost, prefix_cache=True)
    trace = Recorder()
    a = _one_call("A", 0.0, 4 * block, 8, 30.0)
    b = build_request("B", 9 * block + 10, [(1, None)], 1.0)
    sim = Simulator([a, b], profile, policy, trace=trace)
    sim.run()
    events = [e for e in trace.events if e["rid"] == "A"]
    admit = [e for e in events if e["event"] == "admit"][1]
    loaded = next(e for e in events if e["event"] == "swap_in")
    assert loaded["blocks"] == 4
    assert loaded["t"] - admit["t"] == pytest.approx(4 * block / profile.cost.swap_tokens_per_s)
    assert admit["prefill_tokens"] == 0  # it computes nothing until the load is in
    last = [e for e in trace.events if e["event"] == "schedule" and e["t"] >= loaded["t"]][0]
    assert last["tokens"] == 12  # then the 8 generated and the 4 returned tokens
    assert sim.host_tier.stored("A") == 0  # finished: its stored prompt can no longer be hit


def test_without_offloading_the_same_return_recomputes_everything() -> None:
    profile = replace(load_profile("gptj-6b-a100"), device_blocks=10)
    block = profile.block_tokens
    trace = Recorder()
    Simulator([_one_call("A", 0.0, 4 * block, 8, 30.0), build_request("B", 9 * block + 10, [(1, None)], 1.0)],
              profile, make_policy("vllm", profile.cost, prefix_cache=True), trace=trace).run()
    admits = [e["prefill_tokens"] for e in trace.events if e["event"] == "admit" and e["rid"] == "A"]
    assert admits == [4 * block, 4 * block + 12]
    assert not any(e["event"] == "swap_in" for e in trace.events)


def test_offloading_needs_the_prefix_cache() -> None:
    cost = load_profile("gptj-6b-a100").cost
    policy = make_policy("vllm-offload", cost, prefix_cache=False)
    assert not policy.offload and not policy.prefix_cache
    assert make_policy("continuum", cost).rule.value == "ttl"
    assert make_policy("autellix", cost).starvation.per_service
    assert Strategy.DISCARD is make_policy("autellix", cost).strategy_for_gap(100, 1.0, EngineLoad(0, 0, 0.02, 0))

"""`infercept-code`: INFERCEPT as its published code schedules (WukLab/InferCept@3a1a4da
`vllm/core/scheduler_v2.py`): the formulas, and the engine's passes, budgets and evictions."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from marsched.policy import CostModel, make_policy
from marsched.policy.infercept_code import (
    GPTJ_6B_SWAP_FIT, PausedWaste, SwapBudgetFit, SwapBudgets, chunked_discard_waste, discard_and_targets,
    recompute_chunk_tokens, swap_budgets,
)
from marsched.sim.engine import Phase, Simulator
from marsched.sim.select import make_simulator
from simhelpers import COST, single, small_profile, two_segment
from test_block_accounting import requests
from test_engine_semantics import Recorder

INFERCEPT_6B = CostModel(seconds_per_token=0.0463e-3, seconds_per_iteration=0.010, token_budget=384,
                         swap_tokens_per_s=1e6)


# --- formulas ---------------------------------------------------------------------------

def test_swap_budgets_are_the_codes_for_gptj_with_64_token_blocks():
    # The reference notes: with B = 64 and F = 0, 1 block in and 7 out per iteration for 6B, 0 and 5 for 13B.
    assert swap_budgets(0, 384, 64) == SwapBudgets(1, 7)
    assert swap_budgets(0, 384, 64, SwapBudgetFit(alpha=-0.3297119141, offset_tokens=93.994140625)) == SwapBudgets(0, 5)
    # Swapping out stops once about 860 tokens are free; swapping in grows with free memory.
    assert swap_budgets(832, 384, 64).out_blocks == 1
    assert swap_budgets(896, 384, 64).out_blocks == 0
    assert swap_budgets(100_000, 384, 64) == SwapBudgets((0.00462 * 384 + 108.99 + 50_000) // 64, 0)


def test_the_recompute_chunk_is_what_the_running_batch_leaves_of_the_budget():
    assert recompute_chunk_tokens(384, 84) == 300
    assert recompute_chunk_tokens(384, 384) == 1
    assert recompute_chunk_tokens(384, 1000) == 1


def test_chunked_discard_waste_by_hand():
    # L = 1000 tokens in chunks of 300: n = 3 full chunks and a rest of 100; R = 2000 running tokens.
    full = 0.010 + 0.0463e-3 * 384
    expected = full * 300 * 3 * 4 / 2 + 0.0463e-3 * 300 * 3 * 2000 + 0.0463e-3 * 100 * (2000 + 100)
    assert chunked_discard_waste(1000, 300, 2000, INFERCEPT_6B) == pytest.approx(expected)
    # An exact multiple leaves no rest: n = 1.
    assert chunked_discard_waste(600, 300, 0, INFERCEPT_6B) == pytest.approx(full * 300)
    # A saturated batch (chunks of 1 token) makes a discard cost more than keeping the context through
    # a 10 s call, and 50 times what it costs with 300-token chunks.
    saturated = chunked_discard_waste(1000, 1, 2000, INFERCEPT_6B)
    assert saturated > 1000 * 10 and saturated > 50 * chunked_discard_waste(1000, 300, 2000, INFERCEPT_6B)


def test_all_cheaper_candidates_but_the_costliest_are_discarded_and_it_becomes_the_target():
    wastes = [PausedWaste("a", 50, 10), PausedWaste("b", 50, 30), PausedWaste("c", 20, 40), PausedWaste("d", -5, 1)]
    assert discard_and_targets(wastes) == (["a"], ["b"])  # c is cheaper kept; d overran its call: kept
    assert discard_and_targets([PausedWaste("a", 50, 10)]) == ([], ["a"])  # a lone candidate is only a target
    assert discard_and_targets([PausedWaste("a", 50, 30), PausedWaste("b", 60, 30)]) == ([], ["a", "b"])
    assert discard_and_targets([PausedWaste("a", 5, 10)]) == ([], [])


# --- the engine ---------------------------------------------------------------------------

def _run(requests, profile, cost=COST, **kwargs):
    states = []

    def step(sim):
        sim.check_invariants()
        states.append({r.rid: (r.phase.value, r.device_blocks, r.host_blocks, r.progress.computed_tokens)
                       for r in sim.live.values()})

    sim = make_simulator(requests, profile, make_policy("infercept-code", cost), on_step=step, **kwargs)
    result = sim.run()
    assert len(result.records) == len(requests) and sim.device.used == 0 and sim.host.used == 0
    return sim, {r.request_id: r for r in result.records}, states


def _target_and_newcomer():
    """A pauses for 5 s holding 5 blocks of a 12-block device; C then needs 11 blocks."""
    return [two_segment("A", 0.0, 64, 8, 5.0, 4, 8), single("C", 0.3, 150, 20)]


def test_a_preserved_call_cheaper_to_discard_is_preserved_while_the_running_batch_fills_the_budget():
    calls = [two_segment("A", 0.0, 40, 8, 0.5, 4, 8), two_segment("B", 0.0, 80, 8, 0.5, 4, 8)]
    _, idle, _ = _run(calls, small_profile(device_blocks=2000))
    assert {idle["A"].strategies, idle["B"].strategies} == {("discard",), ("preserve",)}
    # A 6,000-token prompt keeps the batch's pending tokens above the budget for the whole call.
    _, busy, _ = _run(calls + [single("T", 0.001, 6000, 2)], small_profile(device_blocks=2000))
    assert busy["A"].strategies == busy["B"].strategies == ("preserve",)


def test_a_shortfall_swaps_blocks_out_from_the_tail_of_the_target_and_they_come_back_before_it_computes():
    # A budget of 384 tokens and this fit give 16 blocks out when C is short, 1 block in when A returns.
    cost = dataclasses.replace(COST, token_budget=384)
    fit = SwapBudgetFit(alpha=0.0, offset_tokens=-64.0)
    sim, records, states = _run(_target_and_newcomer(), small_profile(device_blocks=12, host_blocks=64), cost,
                                swap_fit=fit)
    partial = [s["A"] for s in states if "A" in s and s["A"][0] == "paused" and s["A"][1] and s["A"][2]]
    assert partial, "the target never held blocks on both sides"
    assert sim.swapped_out_blocks == sim.swapped_in_blocks == 4
    assert records["A"].strategies == ("preserve",) and records["C"].preemptions == 0
    assert records["C"].ttft_s < 0.5  # C did not wait for A's call
    returning = [s["A"] for s in states if "A" in s and s["A"][0] == "running" and s["A"][2]]
    assert len(returning) == 3  # back a block per iteration: 3 iterations with blocks still on the host
    for before, after in zip(states, states[1:]):  # and no token computed meanwhile
        if "A" in before and "A" in after and after["A"][3] > before["A"][3]:
            assert after["A"][2] == 0


def test_a_shortfall_above_the_swap_out_budget_delays_the_request_instead():
    # This fit gives at most one block out, none once 24 tokens are free; C is short of a block with 112 free.
    tight = SwapBudgetFit(alpha=0.0, offset_tokens=-100.0)
    sim, records, _ = _run(_target_and_newcomer(), small_profile(device_blocks=12, host_blocks=64), swap_fit=tight)
    assert sim.swapped_out_blocks == 0
    assert records["C"].first_token_s > 5.0  # it waited for A's call to return and free its blocks


def test_a_target_swapped_out_whole_becomes_a_swap_and_returns_to_a_recompute_when_nothing_waits():
    requests = [two_segment("A", 0.0, 64, 8, 1.0, 4, 8), single("C", 0.3, 176, 15)]
    sim, records, states = _run(requests, small_profile(device_blocks=12, host_blocks=64))
    assert any(s.get("A", ("",))[0] == "paused" and s["A"][1:3] == (0, 5) for s in states)
    assert records["A"].strategies == ("swap",)
    # Its call returned with the queue empty: the oldest swapped request is recomputed, not swapped in.
    assert records["A"].preemptions == 1 and sim.swapped_in_blocks == 0


def test_with_the_host_full_the_target_is_discarded():
    sim, records, _ = _run(_target_and_newcomer(), small_profile(device_blocks=12, host_blocks=2))
    assert records["A"].strategies == ("discard",)
    assert records["C"].preemptions == 0


def test_the_plain_simulator_refuses_the_policy():
    with pytest.raises(ValueError, match="infercept-code.*make_simulator"):
        Simulator(_target_and_newcomer(), small_profile(), make_policy("infercept-code", COST))


def test_gptj_fit_is_the_default():
    sim = make_simulator(_target_and_newcomer(), small_profile(), make_policy("infercept-code", COST))
    assert sim.swap_fit == GPTJ_6B_SWAP_FIT


def test_a_fit_with_no_swap_in_budget_still_brings_the_blocks_back_a_block_at_a_time():
    cost = dataclasses.replace(COST, token_budget=384)
    none_in = SwapBudgetFit(alpha=0.0, offset_tokens=-200.0)  # (F/2 − 200) // 16: nothing in below 400 free tokens
    assert swap_budgets(12 * 16, 384, 16, none_in).in_blocks == 0
    sim, records, _ = _run(_target_and_newcomer(), small_profile(device_blocks=12, host_blocks=64), cost,
                           swap_fit=none_in)
    assert sim.swapped_out_blocks == sim.swapped_in_blocks > 0


def test_a_running_request_short_of_more_blocks_than_the_budget_waits_and_a_stall_lifts_the_budget():
    no_out = SwapBudgetFit(alpha=0.0, offset_tokens=-120.0)  # nothing out at any free memory
    requests = [two_segment("A", 0.0, 64, 8, 5.0, 4, 8), single("C", 0.3, 96, 40)]
    sim, records, states = _run(requests, small_profile(device_blocks=12, host_blocks=64), swap_fit=no_out)
    # C outgrows the free blocks while A's call runs: it waits (running, not preempted) for A's return.
    assert any(s.get("C", ("",))[0] == "running" and s["A"][0] == "paused" for s in states)
    assert records["C"].finish_s > 5.0
    # Then both need blocks, none are free, nothing is due: the budget is lifted and C swaps out.
    assert records["C"].preemptions == 1 and sim.swapped_out_blocks == sim.swapped_in_blocks > 0


def test_with_the_host_full_a_swapped_call_is_discarded_to_make_room_for_the_next_target():
    requests = [two_segment("B", 0.0, 64, 8, 10.0, 4, 8), single("C", 0.2, 176, 15),
                two_segment("A", 1.0, 64, 8, 5.0, 4, 8), single("D", 1.3, 150, 10)]
    sim, records, states = _run(requests, small_profile(device_blocks=12, host_blocks=6))
    assert any(s.get("B", ("",))[0] == "paused" and s["B"][1:3] == (0, 5) for s in states)  # B went out whole
    # A's first block fits beside B's five in the 6-block host: B is dropped only when the host is short.
    assert any(s.get("B", ("",))[1:3] == (0, 5) and s.get("A", ("", 0, 0))[2] == 1 for s in states)
    assert records["B"].strategies == ("discard",)  # then made room on the host for A's blocks
    assert records["A"].strategies == ("preserve",) and sim.swapped_out_blocks > 5
    assert records["C"].preemptions == records["D"].preemptions == 0


@pytest.mark.parametrize("extra", [{"admission": "predicted-peak"}, {"starvation": "age"},
                                   {"starvation_threshold": 50}])
def test_admission_and_starvation_the_code_does_not_have_are_refused(extra):
    with pytest.raises(ValueError, match="greedy admission and no starvation prevention"):
        make_policy("infercept-code", COST, **extra)


def test_a_context_shorter_than_the_chunk_is_recomputed_in_one_go():
    # n = 0 full chunks, a rest of 100: only the rest's term.
    assert chunked_discard_waste(100, 300, 2000, INFERCEPT_6B) == pytest.approx(0.0463e-3 * 100 * 2100)


def test_a_call_exactly_as_costly_to_discard_as_to_keep_is_kept():
    assert discard_and_targets([PausedWaste("a", 10, 10)]) == ([], [])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workload=requests(), device_blocks=st.integers(min_value=40, max_value=90),
       host_blocks=st.integers(min_value=0, max_value=40))
def test_every_iteration_keeps_to_the_token_budget_and_the_swap_budgets(workload, device_blocks, host_blocks):
    holder = {}
    moved = {"in": 0, "out": 0}
    preempt_events = {}

    def watch(event):
        sim = holder["sim"]
        kind = event["event"]
        if kind in ("swap_in", "swap_out"):
            moved[kind[5:]] += event["blocks"]
        elif kind == "preempt":
            preempt_events[event["rid"]] = preempt_events.get(event["rid"], 0) + 1
        elif kind == "schedule":
            assert event["tokens"] <= COST.token_budget and event["iterations"] == 1
            assert moved["in"] <= sim.budgets.in_blocks
            if math.isfinite(sim._out_left):  # not lifted: what the budget paid for went out, no more
                used = sim.budgets.out_blocks - sim._out_left
                assert 0 <= used <= moved["out"]
            moved.update({"in": 0, "out": 0})

    def step(sim):
        sim.check_invariants()
        for r in sim.live.values():  # a request waiting for a (re)computation holds no KV anywhere
            if r.phase is Phase.WAITING:
                assert r.device_blocks == r.host_blocks == r.progress.computed_tokens == 0

    sim = make_simulator(workload, small_profile(device_blocks=device_blocks, host_blocks=host_blocks),
                         make_policy("infercept-code", COST), trace=Recorder(watch), on_step=step)
    holder["sim"] = sim
    result = sim.run()
    assert len(result.records) == len(workload) and sim.device.used == sim.host.used == 0
    assert result.iterations == result.steps  # every iteration priced and built on its own
    assert {r.request_id: r.preemptions for r in result.records if r.preemptions} == preempt_events


def test_a_discarded_call_prefills_its_whole_context_when_it_returns():
    events = []
    calls = [two_segment("A", 0.0, 40, 8, 0.5, 4, 8), two_segment("B", 0.0, 80, 8, 0.5, 4, 8)]
    sim = make_simulator(calls, small_profile(device_blocks=2000), make_policy("infercept-code", COST),
                         trace=Recorder(events.append))
    records = {r.request_id: r for r in sim.run().records}
    assert records["A"].strategies == ("discard",)
    after_return = [e for e in events if e["rid"] == "A" and e["event"] == "admit" and e["segment"] == 1]
    assert after_return[0]["prefill_tokens"] == 40 + 8 + 4  # prompt, output and returned tokens, from scratch


def _swapped_call_returning_to_a_queue():
    """A's call is swapped out whole by C; while it runs, W1..W4 queue up for the 12-block device."""
    return ([two_segment("A", 0.0, 64, 8, 1.0, 4, 8), single("C", 0.3, 176, 15)]
            + [single(f"W{i}", 0.35 + 0.01 * i, 150, 30) for i in range(1, 5)])


def test_a_swapped_call_returning_while_others_wait_swaps_back_in_through_the_swapped_pass():
    sim, records, states = _run(_swapped_call_returning_to_a_queue(), small_profile(device_blocks=12, host_blocks=64))
    assert any(s.get("A", ("",))[0] == "swapped" and s["A"][1:3] == (0, 5) for s in states)
    assert records["A"].strategies == ("swap",) and records["A"].preemptions == 0  # not recomputed
    assert sim.swapped_in_blocks == sim.swapped_out_blocks == 5


def test_swap_ins_keep_to_the_budget_and_take_blocks_from_a_later_running_request():
    # With a budget of 384 tokens this fit lets 1 block in per iteration once memory is nearly full.
    cost = dataclasses.replace(COST, token_budget=384)
    sim, records, states = _run(_swapped_call_returning_to_a_queue(), small_profile(device_blocks=12, host_blocks=64),
                                cost, swap_fit=SwapBudgetFit(alpha=0.0, offset_tokens=-80.0))
    coming_back = [s for s in states if s.get("A", ("",))[0] == "running" and s["A"][2]]
    assert [s["A"][1:] for s in coming_back] == [(1, 4, 71), (2, 3, 71), (3, 2, 71), (4, 1, 71)]
    # The one block in per iteration is all that comes in: the others' host blocks only grow meanwhile.
    others_on_host = [sum(v[2] for k, v in s.items() if k != "A") for s in coming_back]
    assert others_on_host == sorted(others_on_host)
    # The running request that arrived after A gives up its tail to make room for A's blocks.
    assert all(any(v[0] == "running" and v[2] for k, v in s.items() if k.startswith("W")) for s in coming_back[2:])
    assert records["A"].preemptions == 0


@pytest.mark.parametrize("offset, requests", [
    (-104.0, [two_segment("A", 0.0, 64, 8, 5.0, 4, 8), single("C", 0.3, 96, 40)]),  # running pass: short 1 block, F = 0
    (-50.0, _target_and_newcomer()),  # waiting pass: C short of 1 block with 112 tokens free
])
def test_a_shortfall_equal_to_the_swap_out_budget_is_swapped_not_delayed(offset, requests):
    one_out = SwapBudgetFit(alpha=0.0, offset_tokens=offset)
    assert swap_budgets(0 if offset == -104.0 else 112, 128, 16, one_out).out_blocks == 1
    sim, records, _ = _run(requests, small_profile(device_blocks=12, host_blocks=64), swap_fit=one_out)
    assert sim.swapped_out_blocks > 0 and records["C"].finish_s < 5.0  # C did not wait for A's call


def test_a_call_is_kept_when_recomputing_it_would_slow_a_large_running_batch():
    calls = [two_segment("A", 2.0, 40, 8, 0.3, 4, 8), two_segment("B", 2.0, 80, 8, 0.3, 4, 8)]
    _, alone, _ = _run(calls, small_profile(device_blocks=2000))
    assert alone["A"].strategies == ("discard",)
    # Twenty requests decoding 500-token contexts: little of the budget used, but ~11,000 running KV
    # tokens that every recompute chunk would slow (the R terms of the waste).
    decoders = [single(f"D{i}", 0.0, 500, 300) for i in range(20)]
    _, busy, _ = _run(calls + decoders, small_profile(device_blocks=2000))
    assert busy["A"].strategies == busy["B"].strategies == ("preserve",)


def test_with_no_host_memory_a_later_running_request_is_recomputed_to_make_room():
    requests = [single("R1", 0.0, 90, 40), single("R2", 0.01, 40, 60)]
    sim, records, _ = _run(requests, small_profile(device_blocks=12, host_blocks=0))
    assert records["R2"].preemptions >= 1 and records["R1"].preemptions == 0
    assert sim.swapped_out_blocks == 0


def test_a_waiting_request_that_needs_exactly_the_free_blocks_is_admitted():
    # R1 holds 4 of 12 blocks; R2's first chunk (128 tokens) needs the other 8.
    _, records, _ = _run([single("R1", 0.0, 48, 10), single("R2", 0.05, 128, 2)], small_profile(device_blocks=12))
    assert records["R2"].first_token_s < records["R1"].finish_s


def test_a_waiting_request_short_of_blocks_with_no_target_holds_back_those_behind_it():
    # R2 does not fit beside R1 and nothing is paused to take blocks from: R3, which would fit, waits too.
    requests = [single("R1", 0.0, 100, 30), single("R2", 0.02, 128, 2), single("R3", 0.03, 16, 2)]
    _, records, _ = _run(requests, small_profile(device_blocks=12))
    assert records["R1"].finish_s < records["R2"].first_token_s < records["R3"].first_token_s


def test_a_shortfall_takes_only_the_blocks_that_are_missing():
    # With 14 blocks C's second chunk needs 3 more with 1 free: 2 come from A, then 1 for C's growth.
    sim, _, states = _run(_target_and_newcomer()[:1] + [single("C", 0.3, 176, 15)], small_profile(device_blocks=14))
    assert {s["A"][1:3] for s in states if s.get("A", ("",))[0] == "paused"} == {(5, 0), (3, 2), (2, 3)}
    assert sim.swapped_out_blocks == 3


def test_with_the_host_full_the_swapped_call_with_the_longest_remaining_time_is_discarded_first():
    # A2 (5 s call) and then A1 (10 s call) are swapped out whole, filling the 10-block host; when B's
    # blocks must go out, A1, which has the longer call still to run, makes the room.
    requests = [two_segment("A2", 0.0, 64, 8, 5.0, 4, 8), single("C1", 0.3, 176, 15),
                two_segment("A1", 1.0, 64, 8, 10.0, 4, 8), single("C2", 1.3, 176, 15),
                two_segment("B", 2.0, 64, 8, 5.0, 4, 8), single("D", 2.3, 150, 10)]
    _, records, states = _run(requests, small_profile(device_blocks=12, host_blocks=10))
    assert any(s.get("A1", ("",))[1:3] == (0, 5) and s.get("A2", ("",))[1:3] == (0, 5) for s in states)
    assert records["A1"].strategies == ("discard",) and records["A2"].strategies == ("swap",)
    assert records["B"].strategies == ("preserve",) and records["D"].preemptions == 0

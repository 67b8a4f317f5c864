"""`Simulator(queued_turns=True)`: a call's return comes back as a new request (a client running its
own tools, as the live twin's loadgen does over HTTP), so a follow-up whose KV was kept on the
device waits in the queue like any turn, holding its blocks, and gives them up when the queue's
head does not fit (`marsched serve`'s `ConversationKeeper.relieve`). What is kept of a turn is its
full blocks, as `marsched serve` pins or copies them."""

from __future__ import annotations

from dataclasses import replace

import pytest

from marsched.policy.policy import StrategyRule
from marsched.policy.registry import make_policy
from marsched.policy.ttl import ConstantTtl
from marsched.sim.engine import Simulator
from marsched.sim.profile import load_profile
from marsched.workload.model import ApiCall, ApiType, build_request
from tests.test_engine_semantics import Recorder


def _run(requests, profile, policy, queued_turns):
    trace = Recorder()
    sim = Simulator(requests, profile, policy, trace=trace, queued_turns=queued_turns,
                    on_step=lambda s: s.check_invariants())
    sim.run()
    finish = {e["rid"]: e["t"] for e in trace.events if e["event"] == "finish"}
    admits = [(e["rid"], e["prefill_tokens"]) for e in trace.events if e["event"] == "admit"]
    resumed = [e["where"] for e in trace.events if e["event"] == "resume"]
    return sim, finish, admits, resumed


def test_a_pinned_follow_up_waits_for_room_in_the_batch_as_a_new_turn_does():
    """One sequence at a time: `a` calls (pinned) while `b` runs. Inside vLLM its return rejoins the
    batch at once; as a new turn it waits for `b`, and then computes only past its kept blocks."""
    profile = replace(load_profile("gptj-6b-a100"), max_sequences=1)
    block = profile.block_tokens
    requests = [build_request("a", 4 * block, [(4, ApiCall(ApiType.MATH, 0.05, 4)), (4, None)], 0.0),
                build_request("b", block, [(60, None)], 0.001)]
    policy = make_policy("continuum-public", profile.cost, prefix_cache=True)
    _, finish, admits, resumed = _run(requests, profile, policy, queued_turns=False)
    assert resumed == ["device"] and finish["a"] < finish["b"]
    _, finish, admits, resumed = _run(requests, profile, make_policy("continuum-public", profile.cost, prefix_cache=True),
                                      queued_turns=True)
    assert resumed == ["waiting"] and finish["b"] < finish["a"]
    # Past its 4 kept full blocks: the 3 computed tokens of its partial block, which is not kept
    # (`marsched serve` keeps full blocks), the last token sampled before the call, and the 4 returned.
    assert admits[-1] == ("a", 8)


@pytest.mark.parametrize("past_full_blocks", [10, -3])
def test_a_follow_up_over_http_finds_its_turns_full_blocks_kept_on_the_host_too(past_full_blocks):
    profile = load_profile("gptj-6b-a100")
    block = profile.block_tokens
    requests = [build_request("a", 4 * block + past_full_blocks, [(4, ApiCall(ApiType.MATH, 0.05, 4)), (4, None)], 0.0)]
    # Swapped out with 4 full blocks and 13 tokens of a fifth: inside vLLM all 5 come back and it
    # computes the last sampled token and the 4 returned; over HTTP the 4 full blocks, and the 13 again.
    # A turn that ends on a block's end keeps all it computed.
    partial = (past_full_blocks + 3) % block
    expected = ((False, 4 + (partial > 0), 1 + 4), (True, 4, partial + 1 + 4))
    for queued_turns, swapped_in, computed in expected:
        trace = Recorder()
        sim = Simulator(requests, profile, make_policy("swap", profile.cost), trace=trace, queued_turns=queued_turns,
                        on_step=lambda s: s.check_invariants())
        sim.run()
        events = [e for e in trace.events if e["event"] in ("swap_in", "schedule")]
        back = next(i for i, e in enumerate(events) if e["event"] == "swap_in")
        assert events[back]["blocks"] == swapped_in and events[back + 1]["tokens"] == computed
        assert sim.host.used == 0 and sim.device.used == 0


def test_a_held_follow_up_gives_its_blocks_to_the_head_and_keeps_a_prefix_in_the_cache():
    """`a`'s follow-up waits (two sequences at most) holding 5 of 12 blocks; the head of the queue,
    ranked first, needs 8 when the batch empties: `a` yields, and what the head's allocation leaves
    of its blocks (its prefix: the tail goes first) is a prefix hit when it runs."""
    profile = replace(load_profile("gptj-6b-a100"), device_blocks=12, max_sequences=2)
    block = profile.block_tokens
    policy = replace(make_policy("sjf", profile.cost, prefix_cache=True), rule=StrategyRule.TTL, ttl=ConstantTtl(5.0))
    requests = [build_request("a", 4 * block, [(4, ApiCall(ApiType.MATH, 0.05, 4)), (4, None)], 0.0),
                build_request("b", block, [(20, None)], 0.001), build_request("c", block, [(20, None)], 0.001),
                build_request("big", 8 * block - 8, [(1, None)], 0.2)]
    sim, finish, admits, _ = _run(requests, profile, policy, queued_turns=True)
    assert sim.yielded_turns == 1 and not sim.held
    assert [rid for rid, _ in admits][-2:] == ["big", "a"]
    context = 4 * block + 4 + 4
    assert 5 < admits[-1][1] < context  # more than the new tokens, less than the whole context
    assert set(finish) == {"a", "b", "c", "big"}

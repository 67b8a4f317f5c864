"""The profile's cap on running requests (vLLM's max_num_seqs) in both simulated engines."""

from dataclasses import replace

import pytest

from marsched.policy import make_policy
from marsched.sim.engine import Simulator
from marsched.sim.profile import load_profile
from simhelpers import COST, single, small_profile, two_segment
from test_engine_semantics import _run


def _burst(n: int):
    return [single(f"r{i}", 0.0, 16, 20) for i in range(n)]


def _most_running(requests, profile, policy) -> int:
    most = []
    Simulator(requests, profile, policy, on_step=lambda sim: most.append(len(sim.running) + len(sim.link_in))).run()
    return max(most)


def test_no_more_requests_run_than_the_cap_and_all_finish():
    policy = make_policy("infercept", COST)
    assert _most_running(_burst(6), small_profile(), policy) == 6  # memory and budget let all six in
    capped = replace(small_profile(), max_sequences=2)
    assert _most_running(_burst(6), capped, policy) == 2
    result = Simulator(_burst(6), capped, policy).run()
    assert len(result.records) == 6
    # Two at a time, so the last two start only after two pairs have finished.
    starts = sorted(r.first_token_s for r in result.records)
    assert starts[2] > starts[1] and starts[4] > starts[3]


def test_a_request_swapping_in_takes_a_place_in_the_batch():
    # a swaps 1,000 tokens out for its call; on a link of 2,000 tokens/s it comes back for about
    # half a second after the call, and b arrives meanwhile: b waits until a is back and done.
    slow = replace(COST, swap_tokens_per_s=2_000)
    requests = [two_segment("a", 0.0, 1000, 4, 1.0, 4, 20), single("b", 1.3, 16, 20)]
    profile = replace(small_profile(device_blocks=80, host_blocks=80), cost=slow, max_sequences=1)
    seen = []

    def watch(sim):
        seen.append((sim.now, len(sim.running), len(sim.link_in)))
        assert len(sim.running) + len(sim.link_in) <= 1

    result = Simulator(requests, profile, make_policy("swap", slow), on_step=watch).run()
    records = {r.request_id: r for r in result.records}
    assert any(swapping and t >= 1.3 for t, _, swapping in seen)  # b had arrived during a's swap-in
    assert records["b"].first_token_s > records["a"].finish_s


def test_infercept_code_schedules_at_most_the_cap_each_iteration():
    requests = [two_segment(f"r{i}", 0.0, 16, 4, 0.2, 4, 10) for i in range(5)]
    for cap, most in ((None, 5), (3, 3)):
        profile = replace(small_profile(), max_sequences=cap)
        _, _, events = _run(requests, make_policy("infercept-code", COST), profile)
        batches = [e["batch"] for e in events if e["event"] == "schedule"]
        assert max(batches) == most


@pytest.mark.parametrize("name", ["gptj-6b-a100", "vicuna-13b-2xa100"])
def test_bundled_profiles_cap_at_vllms_default(name):
    assert load_profile(name).max_sequences == 256

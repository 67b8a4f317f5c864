"""The profile's `admits_whole_prompt` (vLLM's `scheduler_reserve_full_isl`): a waiting request starts
only when its whole prompt fits, not just its first chunk."""

from dataclasses import replace

import pytest

from marsched.policy import make_policy
from marsched.sim.engine import Simulator
from simhelpers import COST, single, small_profile


def _together(admits_whole_prompt: bool) -> tuple[bool, dict]:
    """a (a 700-token prompt: 44 of the 64 blocks; then 100 tokens out) and b (400 tokens: 25 blocks)
    arriving just after: whether both ever run at once. a's prefill takes the whole token budget
    until its last chunk; then b's first chunk would take 5 blocks."""
    requests = [single("a", 0.0, 700, 100), single("b", 0.001, 400, 20)]
    profile = replace(small_profile(), admits_whole_prompt=admits_whole_prompt)
    both = []
    result = Simulator(requests, profile, make_policy("vllm", COST),
                       on_step=lambda sim: both.append({"a", "b"} <= {r.rid for r in sim.running})).run()
    return any(both), {r.request_id: r for r in result.records}


def test_a_prompt_that_does_not_fit_whole_waits_though_its_first_chunk_would():
    chunked, _ = _together(admits_whole_prompt=False)
    assert chunked  # b's first chunk fits beside a: b starts at once
    whole, records = _together(admits_whole_prompt=True)
    assert not whole  # 20 blocks free, 25 needed: b waits for a
    assert records["b"].first_token_s > records["a"].finish_s


@pytest.mark.parametrize("blocks,starts", [(70, True), (68, False)])
def test_the_whole_prompt_counts_against_the_free_blocks(blocks, starts):
    # When b can start (a's last prefill chunk leaves budget), a holds 44 blocks and b needs 25:
    # beside a from 69 blocks on.
    requests = [single("a", 0.0, 700, 4), single("b", 0.001, 400, 4)]
    profile = replace(small_profile(device_blocks=blocks), admits_whole_prompt=True)
    both = []
    Simulator(requests, profile, make_policy("vllm", COST),
              on_step=lambda sim: both.append({"a", "b"} <= {r.rid for r in sim.running})).run()
    assert any(both) is starts

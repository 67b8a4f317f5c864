"""A call that compacts the context (`ApiCall.kept_tokens`): what the simulator frees and
recomputes at the return, and what the policy's waste, ranking and outlook predict.

Numbers are worked by hand with the test engine of `simhelpers` (16-token blocks,
`t(n) = 10 ms + 0.05 ms·n`, a 128-token budget, a 20,000 tokens/s host link).
"""

from __future__ import annotations

import pytest

from marsched.metrics.trace import TraceFile
from marsched.audit import audit_trace
from marsched.policy import make_policy
from marsched.policy.compaction import cached_after_call, kept_context, next_context
from marsched.policy.load import EngineLoad
from marsched.policy.progress import RequestProgress
from marsched.policy.ranking import RankingTerms, SegmentOutlook, call_area, remaining_area_form
from marsched.policy.strategy import Strategy
from marsched.policy.waste import call_wastes, discard_waste, swap_waste
from marsched.predict.segment import SegmentPrediction
from marsched.sim.isolated import isolated_latency
from marsched.sim.request import SimRequest
from marsched.sim.select import make_simulator
from marsched.workload import ApiCall, ApiType, build_request
from simhelpers import COST, small_profile
from test_engine_semantics import Recorder


def t(tokens: int) -> float:
    return 0.01 + 5e-5 * tokens


def _compacting(api_s=1.0, kept=40, returned=10, second=3, rid="R"):
    # 100-token prompt, 4 tokens out; the call keeps `kept` of the 104 tokens at the call and returns `returned`.
    return build_request(rid, 100, [(4, ApiCall(ApiType.OTHER, api_s, returned, kept)), (second, None)])


# --- the rule -----------------------------------------------------------------------------


def test_the_rule_keeps_the_prefix_and_never_the_whole_next_context():
    assert kept_context(104, None) == 104
    assert kept_context(104, 40) == 40
    assert kept_context(30, 40) == 30  # a prediction's context may fall short of the kept prefix
    assert next_context(104, 40, 10) == 50
    assert next_context(104, None, 10) == 114
    assert cached_after_call(103, None, 114) == 103  # no compaction: all that was cached
    assert cached_after_call(103, 40, 50) == 40  # the tail past the kept prefix is of no use
    assert cached_after_call(30, 40, 50) == 30  # less cached than kept (a partial recompute)
    assert cached_after_call(103, 40, 40) == 39  # no return: the last token is computed again
    assert cached_after_call(0, 0, 5) == 0
    assert cached_after_call(5, 0, 0) == 0  # never negative


# --- waste and ranking -------------------------------------------------------------------


def test_wastes_bring_back_only_the_kept_prefix():
    # C = 104 at the call, K = 40 kept, batch 20 tokens. Discard: Tfwd(40)·(40 + 20) = 0.012·60.
    assert discard_waste(104, 20, COST, 40) == pytest.approx(0.012 * 60)
    assert discard_waste(104, 20, COST) == pytest.approx(t(104) * 124)
    # Swap: 104 out, 40 back: 104/20000·104 + 40/20000·40 = 0.5408 + 0.08.
    assert swap_waste(104, COST, 40) == pytest.approx(0.6208)
    assert swap_waste(104, COST) == pytest.approx(2 * 104 / 20_000 * 104)
    wastes = call_wastes(104, 0.5, 20, COST, 40)
    assert (wastes.preserve, wastes.discard, wastes.swap) == pytest.approx((52.0, 0.72, 0.6208))


def test_call_area_brings_back_only_the_kept_prefix():
    assert call_area(Strategy.DISCARD, 104, 1.0, COST, 40) == pytest.approx(0.012 * 40)
    assert call_area(Strategy.SWAP, 104, 1.0, COST, 40) == pytest.approx(0.6208)
    assert call_area(Strategy.PRESERVE, 104, 1.0, COST, 40) == pytest.approx(104.0)  # the call holds all of C
    assert call_area(Strategy.DISCARD, 104, 1.0, COST) == pytest.approx(t(104) * 104)


def test_the_key_prices_the_call_with_its_prediction_of_compaction():
    prediction = SegmentPrediction(4, 1.0, 10, True, kept_tokens=40)
    outlook = [SegmentOutlook(100, 0, 4, prediction, Strategy.DISCARD)]
    form = remaining_area_form(outlook, COST, RankingTerms())
    assert form.fixed == pytest.approx(0.012 * 40)  # Tfwd(40)·40, not Tfwd(104)·104
    assert form.per_iteration_s == 4 * 100 + 10


def _progress(request, policy) -> RequestProgress:
    progress = RequestProgress(request, order_s=0.0)
    policy.start_segment(progress, EngineLoad(0.0, 0, t(1), 10_000))
    return progress


def test_the_outlook_follows_a_compaction_to_the_next_segments():
    # Segment 0: 100 + 4 = 104 at the call, which keeps 40 and returns 10: segment 1 starts at 50,
    # of which the 10 returned are to compute. Its call (2 s, 5 back) keeps everything: segment 2
    # starts at 53 + 5 = 58, the 5 returned and the last token sampled before it to compute.
    request = build_request("R", 100, [(4, ApiCall(ApiType.OTHER, 1.0, 10, 40)), (3, ApiCall(ApiType.OTHER, 2.0, 5)),
                                       (2, None)])
    policy = make_policy("mars", COST)
    progress = _progress(request, policy)
    assert progress.predictions[0].kept_tokens == 40 and progress.predictions[1].kept_tokens is None
    outlook = policy.outlook(progress, EngineLoad(0.0, 0, t(1), 10_000))
    assert [(o.context_tokens, o.prefill_tokens, o.decode_tokens) for o in outlook] == [(100, 100, 4), (50, 10, 3),
                                                                                      (58, 6, 2)]
    # No return after a compaction: the last kept token is computed again.
    request = build_request("R", 100, [(4, ApiCall(ApiType.OTHER, 1.0, 0, 40)), (2, None)])
    outlook = policy.outlook(_progress(request, policy), EngineLoad(0.0, 0, t(1), 10_000))
    assert [(o.context_tokens, o.prefill_tokens) for o in outlook] == [(100, 100), (40, 1)]


def test_a_later_calls_strategy_weighs_its_compaction():
    # Segment 1 starts at 50 and calls at 53 for 4 ms, keeping 5: Preserve 53·0.004 = 0.212;
    # Discard Tfwd(5)·5 = 0.01025·5 = 0.05125; Swap (53² + 5²)/20000 = 0.1417: Discard. Without
    # the compaction Preserve (0.212) beats Swap (2·53²/20000 = 0.2809) and Discard (t(53)·53 = 0.67).
    def later_strategy(kept):
        request = build_request("R", 100, [(4, ApiCall(ApiType.OTHER, 1.0, 10, 40)),
                                           (3, ApiCall(ApiType.OTHER, 0.004, 5, kept)), (2, None)])
        policy = make_policy("mars", COST)
        return policy.outlook(_progress(request, policy), EngineLoad(0.0, 0, t(1), 10_000))[1].strategy

    assert later_strategy(5) is Strategy.DISCARD
    assert later_strategy(None) is Strategy.PRESERVE


def test_strategies_ahead_and_at_the_call_weigh_the_compaction():
    # At the call C = 104 for 0.01 s: Preserve 1.04; without compaction Discard t(104)·104 = 1.58 and
    # Swap 1.0816, so Preserve; keeping 40, Discard costs 0.012·40 = 0.48 and Swap 0.6208: Discard.
    load = EngineLoad(0.0, 0, t(1), 10_000)
    for kept, expected in ((40, Strategy.DISCARD), (None, Strategy.PRESERVE)):
        request = _compacting(api_s=0.01, kept=kept)
        mars = make_policy("mars", COST)
        assert _progress(request, mars).strategy is expected
        infercept = make_policy("infercept", COST)
        progress = _progress(request, infercept)
        progress.computed_tokens = 104
        progress.api_started_s = 0.0
        assert infercept.strategy_at_call(progress, load) is expected
        # Swap refused for lack of host room: the cheaper of the other two, compaction weighed.
        assert infercept.host_full_fallback(progress, load) is expected


def test_infercept_reconsiders_a_preserved_call_with_its_compaction():
    # 1 s call at 104 tokens, keeping 40: at the call Preserve 104 > Discard 0.48, but with 0.001 s
    # left Preserve costs 0.104 and stays; with 0.5 s left Discard (0.48 < 52).
    infercept = make_policy("infercept", COST)
    progress = _progress(_compacting(api_s=1.0, kept=40), infercept)
    progress.computed_tokens, progress.api_started_s, progress.strategy = 104, 0.0, Strategy.PRESERVE
    assert infercept.reconsider(progress, EngineLoad(0.999, 0, t(1), 10_000)) is None
    assert infercept.reconsider(progress, EngineLoad(0.5, 0, t(1), 10_000)) is Strategy.DISCARD


# --- the simulator ------------------------------------------------------------------------


def _run(request, policy_name, **profile):
    """Run `request` alone; returns its record and, at its resume after the call, (context,
    computed, its device blocks, its host blocks, device blocks in use, host blocks in use)."""
    seen = {}

    def watch(event):
        if event["event"] == "resume":
            r = sim.live["R"]
            seen["resumed"] = (r.progress.context_tokens, r.progress.computed_tokens, r.device_blocks, r.host_blocks,
                               sim.device.used, sim.host.used)
            sim.check_invariants()

    sim = make_simulator([request], small_profile(**profile), make_policy(policy_name, COST), trace=Recorder(watch))
    result = sim.run()
    return result.records[0], seen["resumed"]


def test_preserve_frees_the_kv_past_the_kept_prefix_at_the_return():
    # Prefill 100 (t(100) = 15 ms), 3 decodes (10.05 ms each): 103 tokens computed in 7 blocks. The
    # call keeps 40 and returns 10: context 50, 40 cached in 3 blocks, 4 blocks freed; the 10 are
    # prefilled on them (t(10) = 10.5 ms), then 2 decodes. With the old rule it would prefill 11.
    record, resumed = _run(_compacting(), "preserve")
    assert resumed == (50, 40, 3, 0, 3, 0)
    e2e = t(100) + 3 * t(1) + 1.0 + t(10) + 2 * t(1)
    assert record.e2e_s == pytest.approx(e2e, abs=1e-9)
    assert record.isolated_e2e_s == pytest.approx(e2e, abs=1e-9)


def test_discard_recomputes_the_new_context():
    # Discarded at the call; at the return 40 kept + 10 returned = 50 to prefill (t(50) = 12.5 ms),
    # not the 114 the whole context and return would be.
    record, resumed = _run(_compacting(), "discard")
    assert resumed == (50, 0, 0, 0, 0, 0)
    assert record.e2e_s == pytest.approx(t(100) + 3 * t(1) + 1.0 + t(50) + 2 * t(1), abs=1e-9)


def test_swap_brings_back_only_the_kept_blocks():
    # Swapped out whole (7 blocks on the host); at the return 3 blocks stay on the host, 4 are freed.
    record, resumed = _run(_compacting(), "swap")
    assert resumed == (50, 40, 0, 3, 0, 3)
    # Back in: 40 tokens over the link, 2 ms, beside the clock, then the 10 returned.
    assert record.e2e_s > t(100) + 3 * t(1) + 1.0 + t(10) + 2 * t(1)


def test_a_swap_still_copying_out_at_the_return_keeps_the_device_copy_cut_to_the_prefix():
    # A 1 ms call: the 103 tokens take 5.15 ms to copy out, so the copy is dropped at the return.
    record, resumed = _run(_compacting(api_s=0.001), "swap")
    assert resumed == (50, 40, 3, 0, 3, 0)


def test_a_compaction_with_no_return_computes_the_last_kept_token_again():
    record, resumed = _run(_compacting(returned=0), "preserve")
    assert resumed == (40, 39, 3, 0, 3, 0)
    assert record.e2e_s == pytest.approx(t(100) + 3 * t(1) + 1.0 + t(1) + 2 * t(1), abs=1e-9)


def test_a_compaction_to_nothing_frees_every_block():
    record, resumed = _run(_compacting(kept=0), "swap")
    assert resumed == (10, 0, 0, 0, 0, 0)


def test_blocks_partly_on_the_host_go_from_the_tail_first():
    # INFERCEPT's engine moves a call's tail blocks out a few at a time: 4 on the device, 3 on the
    # host; keeping 40 tokens (3 blocks) frees the 3 on the host and 1 on the device.
    sim = make_simulator([_compacting()], small_profile(), make_policy("infercept-code", COST))
    sim_request = SimRequest(RequestProgress(_compacting(), order_s=0.0, computed_tokens=103), device_blocks=4,
                             host_blocks=3)
    sim.device.allocate(4)
    sim.host.allocate(3)
    sim._drop_compacted(sim_request, 40)
    assert (sim_request.device_blocks, sim_request.host_blocks, sim.device.used, sim.host.used) == (3, 0, 3, 0)
    assert sim_request.progress.computed_tokens == 40
    sim._drop_compacted(sim_request, 17)  # 2 blocks
    assert (sim_request.device_blocks, sim_request.host_blocks, sim.device.used) == (2, 0, 2)


def test_a_compaction_that_keeps_every_block_frees_none():
    # All 3 blocks on the host (a swap); keeping 40 tokens needs all 3: nothing is freed.
    sim = make_simulator([_compacting()], small_profile(), make_policy("infercept-code", COST))
    sim_request = SimRequest(RequestProgress(_compacting(), order_s=0.0, computed_tokens=45), host_blocks=3)
    sim.host.allocate(3)
    sim._drop_compacted(sim_request, 40)
    assert (sim_request.device_blocks, sim_request.host_blocks, sim.host.used) == (0, 3, 3)


def test_isolated_latency_prefills_what_the_compaction_leaves():
    assert isolated_latency(_compacting(), COST) == pytest.approx(t(100) + 3 * t(1) + 1.0 + t(10) + 2 * t(1))
    assert isolated_latency(_compacting(returned=0), COST) == pytest.approx(t(100) + 3 * t(1) + 1.0 + t(1) + 2 * t(1))
    plain = build_request("R", 100, [(4, ApiCall(ApiType.OTHER, 1.0, 10)), (3, None)])
    assert isolated_latency(plain, COST) == pytest.approx(t(100) + 3 * t(1) + 1.0 + t(11) + 2 * t(1))


@pytest.mark.parametrize("policy_name", ["mars", "infercept", "vllm", "infercept-code"])
def test_traces_with_compaction_audit_clean(policy_name, tmp_path):
    # Keys of requests whose later calls compact are recomputed from the predictions the trace carries.
    requests = [build_request(f"R{i}", 100 + 7 * i, [(4, ApiCall(ApiType.OTHER, 0.05 * i, 10, 40 + i)),
                                                     (3, ApiCall(ApiType.OTHER, 0.2, 5, 30)), (2, None)], 0.002 * i)
                for i in range(12)]
    trace = TraceFile(tmp_path / "t.jsonl")
    make_simulator(requests, small_profile(device_blocks=24), make_policy(policy_name, COST), trace=trace).run()
    trace.close()
    result = audit_trace(tmp_path / "t.jsonl", policy_name)
    assert result.clean, "\n".join(map(str, result.violations))
    assert result.requests == 12

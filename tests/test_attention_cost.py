"""The cost model's prefill-attention term `e·attention_pairs`: the formulas, the waste and ranking
terms, the simulator, τ, and profiles.

The expected numbers are worked out by hand in the comments, from
`t = c + a·tokens + b·context_tokens + d·sequences + e·pairs` with `pairs(n, k) = n·k + n(n+1)/2`
for n new tokens on k cached ones. `e` is chosen large enough that dropping it, or counting the
pairs with the cached context left out, moves each result far beyond the tolerance.
"""

from __future__ import annotations

import dataclasses
import json
from importlib.resources import files

import pytest

from marsched.lifecycle import IterationTime
from marsched.policy import CostModel, EngineLoad, RequestProgress, make_policy
from marsched.policy.cost_model import attention_pairs
from marsched.policy.ranking import call_area, prefill_area
from marsched.policy.strategy import Strategy
from marsched.policy.waste import discard_waste
from marsched.sim.isolated import isolated_latency
from marsched.sim.profile import Profile, load_profile, profile_from_dict
from simhelpers import single, two_segment
from test_engine_semantics import _OneIterationAtATime, _run, _same

# c = 10 ms, a = 0.05 ms/token, b = 2 µs per context token, d = 1 ms per sequence, e = 10 ns per pair.
C, A, B, D, E = 0.01, 5e-5, 2e-6, 1e-3, 1e-8
COST = CostModel(seconds_per_token=A, seconds_per_iteration=C, token_budget=128, swap_tokens_per_s=20_000,
                 seconds_per_context_token=B, seconds_per_sequence=D, seconds_per_attention_pair=E)
WITHOUT_E = dataclasses.replace(COST, seconds_per_attention_pair=0.0)


def t(tokens: int, context: int, sequences: int, pairs: int) -> float:
    return C + A * tokens + B * context + D * sequences + E * pairs


def _profile(cost: CostModel = COST, device_blocks: int = 64) -> Profile:
    return Profile("attention", "test engine with an attention-pair cost", 1.0, device_blocks, 64, 16, cost)


# --- the pair count --------------------------------------------------------------------


def test_attention_pairs_are_the_causal_count():
    assert attention_pairs(3, 0) == 6  # keys 1 + 2 + 3
    assert attention_pairs(2, 5) == 13  # keys 6 + 7
    assert attention_pairs(1, 99) == 100  # a decode step: its context read
    assert attention_pairs(0, 1000) == 0
    assert attention_pairs(-4, 10) == 0  # negatives count as 0
    assert attention_pairs(4, -10) == 10  # 4 tokens from empty: 1 + 2 + 3 + 4
    # The example: a chunk of 8,192 at 100,000 cached: 819,200,000 + 8,192·8,193/2 = 852,758,528.
    assert attention_pairs(8192, 100_000) == 852_758_528


def test_pairs_do_not_depend_on_the_chunking():
    # 300 tokens as 128 + 128 + 44 from empty: 8,256 + (16,384 + 8,256) + (11,264 + 990) = 45,150 = 300·301/2.
    chunks = attention_pairs(128, 0) + attention_pairs(128, 128) + attention_pairs(44, 256)
    assert chunks == attention_pairs(300, 0) == 45_150


# --- the formulas ------------------------------------------------------------------------


def test_iteration_time_adds_the_pairs_and_old_callers_pay_none():
    assert COST.iteration_time(10, 1000, 3, 5000) == pytest.approx(C + 10 * A + 1000 * B + 3 * D + 5000 * E)
    assert COST.iteration_time(10, 1000, 3) == pytest.approx(C + 10 * A + 1000 * B + 3 * D)


def test_recompute_pays_every_chunks_pairs():
    # 300 tokens in chunks of 128: (128, reads 128, 8,256 pairs), (128, reads 256, 24,640), (44, reads 300, 12,254).
    expected = t(128, 128, 1, 8256) + t(128, 256, 1, 24640) + t(44, 300, 1, 12254)
    assert COST.recompute_time(300) == pytest.approx(expected, rel=1e-12)
    # The pairs alone: 45,150 × 10 ns = 0.4515 ms more than without the term.
    assert COST.recompute_time(300) - WITHOUT_E.recompute_time(300) == pytest.approx(45_150 * E, rel=1e-9)


def test_prefill_on_a_cached_context_pays_its_pairs_with_it():
    # 200 tokens on 1,000 cached: (128 at 1,000: 128,000 + 8,256 = 136,256), (72 at 1,128: 81,216 + 2,628 = 83,844).
    expected = t(128, 1128, 1, 136_256) + t(72, 1200, 1, 83_844)
    assert COST.prefill_time(200, 1000) == pytest.approx(expected, rel=1e-12)
    # 220,100 pairs = 200·1,000 + 200·201/2: 2.2 ms of attention.
    assert COST.prefill_time(200, 1000) - WITHOUT_E.prefill_time(200, 1000) == pytest.approx(220_100 * E, rel=1e-9)


def test_cached_attention_time_is_the_pairs_with_the_cache():
    assert COST.cached_attention_time(101, 899) == pytest.approx(101 * 899 * E)
    assert COST.cached_attention_time(-1, 899) == COST.cached_attention_time(101, -1) == 0


def test_decode_pairs_grow_with_the_reads():
    # 3 sequences reading 500 tokens at the first step: 500, 503, 506, 509 tokens read, as many pairs.
    expected = sum(t(3, 500 + 3 * i, 3, 500 + 3 * i) for i in range(4))
    assert COST.decode_time(500, 4, 3) == pytest.approx(expected, rel=1e-12)
    assert COST.decode_growth_s(3) == pytest.approx(3 * (B + E))


def test_full_iteration_counts_the_chunks_own_pairs():
    assert COST.full_iteration_s == pytest.approx(t(128, 128, 1, 8256), rel=1e-12)


def test_a_negative_pair_cost_is_refused():
    with pytest.raises(ValueError, match="seconds_per_attention_pair"):
        CostModel(A, C, 128, 1.0, seconds_per_attention_pair=-1e-12)


# --- waste and ranking ---------------------------------------------------------------------


def test_discard_waste_pays_the_recompute_attention():
    # Tfwd(300) as in test_recompute_pays_every_chunks_pairs, held for the 300 tokens and a 1,000-token batch.
    expected = (t(128, 128, 1, 8256) + t(128, 256, 1, 24640) + t(44, 300, 1, 12254)) * 1300
    assert discard_waste(300, 1000, COST) == pytest.approx(expected, rel=1e-12)
    assert call_area(Strategy.DISCARD, 300, 5.0, COST) == pytest.approx(expected / 1300 * 300, rel=1e-12)


def test_prefill_area_charges_the_return_its_pairs_with_the_cached_context():
    # P = 1,000 with X = 101 to prefill: Tfwd(101) = t(101, 101, 1, 5,151) = 16.30351 ms; the
    # pairs with the 899 cached tokens, 101 × 899 × 10 ns = 0.90799 ms; held at 1,000 tokens.
    expected = (t(101, 101, 1, 5151) + 101 * 899 * E) * 1000
    assert expected == pytest.approx(17.2115, rel=1e-6)
    assert prefill_area(1000, 101, COST) == pytest.approx(expected, rel=1e-12)
    # Without the term the key is the paper's Tfwd(X)·P (from an empty cache).
    assert prefill_area(1000, 101, WITHOUT_E) == pytest.approx(WITHOUT_E.recompute_time(101) * 1000, rel=1e-12)
    # A first prefill (X = P) has no cached context.
    assert prefill_area(300, 300, COST) == pytest.approx(COST.recompute_time(300) * 300, rel=1e-12)


def test_the_mars_key_of_a_waiting_return_includes_its_cached_attention():
    # 101 tokens to prefill on 899 cached (P = 1,000): the key's prefill term moves by
    # e·(5,151 + 101·899)·1,000 = 1e-8 × 95,950 × 1,000 = 0.9595 token·s; its decode term does not.
    load = EngineLoad(now_s=0.0, running_kv_tokens=0, iteration_s=0.01, host_free_tokens=10**9)
    keys = []
    for cost in (COST, WITHOUT_E):
        policy = make_policy("mars", cost)
        progress = RequestProgress(single("r", 0.0, 1000, 10), order_s=0.0, computed_tokens=899, context_tokens=1000)
        policy.start_segment(progress, load)
        keys.append(policy.queue_key(progress, load))
    assert keys[0] - keys[1] == pytest.approx(0.9595, rel=1e-9)


# --- the simulator ---------------------------------------------------------------------------


def test_a_lone_request_pays_the_pairs_of_its_prefill_and_each_decode_step():
    # 100-token prompt, 20 out: the prefill (100 tokens, reads 100, 5,050 pairs) samples the first
    # token; 19 decode steps read and pair 101, 102, ..., 119 (one stretch of identical iterations).
    _, result, _ = _run([single("R", 0.0, 100, 20)], make_policy("preserve", COST), _profile())
    expected = t(100, 100, 1, 5050) + sum(t(1, 101 + i, 1, 101 + i) for i in range(19))
    (record,) = result.records
    assert record.e2e_s == pytest.approx(expected, rel=1e-12)
    assert record.isolated_e2e_s == pytest.approx(expected, rel=1e-12)
    # The term is 50.5 µs of prefill and 20.9 µs of decode here: far beyond rel=1e-12.
    assert expected - (t(100, 100, 1, 0) + sum(t(1, 101 + i, 1, 0) for i in range(19))) > 7e-5


def test_a_return_prefilled_on_the_kept_context_pays_its_pairs_with_it():
    # Preserve: 40-token prompt, 5 out, a 0.5 s call returning 3, then 4 out. After the call the
    # last sampled token and the return (4 tokens) prefill on 44 cached ones: 4·44 + 10 = 186 pairs.
    request = two_segment("R", 0.0, 40, 5, 0.5, 3, 4)
    expected = (t(40, 40, 1, 820) + sum(t(1, 41 + i, 1, 41 + i) for i in range(4)) + 0.5
                + t(4, 48, 1, 186) + sum(t(1, 49 + i, 1, 49 + i) for i in range(3)))
    assert isolated_latency(request, COST) == pytest.approx(expected, rel=1e-12)
    _, result, _ = _run([request], make_policy("preserve", COST), _profile())
    assert result.records[0].e2e_s == pytest.approx(expected, rel=1e-12)


def test_two_requests_prefilling_together_pay_both_pair_counts():
    # 64 + 32 tokens in one iteration: 64·65/2 + 32·33/2 = 2,080 + 528 = 2,608 pairs, reads 96.
    _, result, events = _run([single("A", 0.0, 64, 1), single("B", 0.0, 32, 1)], make_policy("preserve", COST),
                             _profile())
    (first,) = [e for e in events if e["event"] == "schedule"]
    assert first["dt_s"] == pytest.approx(t(96, 96, 2, 2608), rel=1e-12)
    assert result.end_s == pytest.approx(t(96, 96, 2, 2608), rel=1e-12)


_HEAVY_PAIRS = CostModel(seconds_per_token=0.0, seconds_per_iteration=0.001, token_budget=128, swap_tokens_per_s=20_000,
                         seconds_per_attention_pair=2e-5)


def test_fast_forward_with_growing_pairs_matches_one_at_a_time():
    # Pairs alone make each decode step ~1% longer than the one before; a stretch counted as N·dt
    # (growth without e) would run past the next arrival and part from the step-by-step engine.
    def workload():
        return [single("H", 0.0, 60, 80), single("G", 0.0, 90, 70)] + [single(f"X{i}", 0.05 + 0.0731 * i, 10, 2)
                                                                        for i in range(6)]
    profile = _profile(_HEAVY_PAIRS)
    _, fast, fast_events = _run(workload(), make_policy("preserve", profile.cost), profile)
    _, slow, slow_events = _run(workload(), make_policy("preserve", profile.cost), profile,
                                simulator=_OneIterationAtATime)
    assert fast.steps < fast.iterations and slow.steps == slow.iterations
    assert fast.iterations == slow.iterations
    assert fast.end_s == pytest.approx(slow.end_s, abs=1e-9)
    for fast_record, slow_record in zip(fast.records, slow.records):
        assert _same(dataclasses.asdict(fast_record), dataclasses.asdict(slow_record)), (fast_record, slow_record)


def test_tau_starts_from_a_one_token_iteration_with_its_pair():
    # One pair (10 ns) on an 11.05 ms iteration: compared to 1e-12, not approx's default 1e-6.
    assert IterationTime(COST).seconds == pytest.approx(t(1, 1, 1, 1), rel=1e-12)
    assert IterationTime(COST).seconds != pytest.approx(t(1, 1, 1, 0), rel=1e-12)


# --- profiles ------------------------------------------------------------------------------


def _profile_data(name: str) -> dict:
    return json.loads((files("marsched.sim") / "profiles" / f"{name}.json").read_text())


def test_the_pair_term_is_optional_and_in_nanoseconds():
    data = _profile_data("gptj-6b-a100")
    assert profile_from_dict(data, "old.json").cost.seconds_per_attention_pair == 0.0
    data["iteration_ns_per_attention_pair"] = 0.5
    assert profile_from_dict(data, "new.json").cost.seconds_per_attention_pair == pytest.approx(0.5e-9)


@pytest.mark.parametrize("value", [-0.1, "0.1", None, True, float("nan")])
def test_a_bad_pair_term_names_the_file_and_the_field(value):
    data = _profile_data("gptj-6b-a100")
    data["iteration_ns_per_attention_pair"] = value
    with pytest.raises(ValueError, match=r"my\.json: field 'iteration_ns_per_attention_pair' must be"):
        profile_from_dict(data, "my.json")


def test_the_paper_profiles_keep_no_pair_term():
    # Their sources (the MARS/INFERCEPT constants and the curve fit) give no such term.
    for name in ("gptj-6b-a100", "vicuna-13b-2xa100"):
        assert "iteration_ns_per_attention_pair" not in _profile_data(name)
        assert load_profile(name).cost.seconds_per_attention_pair == 0.0

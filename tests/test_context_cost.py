"""The cost model's context-read (b) and per-sequence (d) terms, in the formulas, profiles and simulator.

Each test here fails if either term is ignored: the expected times are worked out by hand
from `c + a·tokens + b·context_tokens + d·sequences`, with the terms chosen large enough
that dropping one moves a result far beyond the tolerance.
"""

from __future__ import annotations

import dataclasses
import json
from importlib.resources import files

import pytest

from marsched.policy import CostModel, make_policy
from marsched.sim.isolated import isolated_latency
from marsched.sim.profile import Profile, profile_from_dict
from simhelpers import single, two_segment
from test_engine_semantics import _OneIterationAtATime, _run, _same

# c = 10 ms, a = 0.05 ms/token, b = 2 µs per context token read, d = 1 ms per sequence.
C, A, B, D = 0.01, 5e-5, 2e-6, 1e-3
COST = CostModel(seconds_per_token=A, seconds_per_iteration=C, token_budget=128, swap_tokens_per_s=20_000,
                 seconds_per_context_token=B, seconds_per_sequence=D)


def t(tokens: int, context: int, sequences: int) -> float:
    return C + A * tokens + B * context + D * sequences


def _profile(device_blocks: int = 64) -> Profile:
    return Profile("context", "test engine with context and sequence costs", 1.0, device_blocks, 64, 16, COST)


# --- formulas ------------------------------------------------------------------------


def test_iteration_time_adds_both_terms_and_old_callers_keep_the_linear_model():
    assert COST.iteration_time(10, 1000, 3) == pytest.approx(C + 10 * A + 1000 * B + 3 * D)
    assert COST.iteration_time(10) == pytest.approx(C + 10 * A)  # positional callers: no context, no sequences
    linear = CostModel(A, C, 128, 20_000)  # the four positional fields still build a linear model
    assert linear.iteration_time(10, 1000, 3) == pytest.approx(C + 10 * A)


def test_recompute_reads_each_chunks_end_position_one_sequence_per_chunk():
    # 300 tokens in chunks of 128: 128 (reads 128), 128 (reads 256), 44 (reads 300).
    assert COST.recompute_time(300) == pytest.approx(t(128, 128, 1) + t(128, 256, 1) + t(44, 300, 1))
    assert COST.recompute_time(256) == pytest.approx(t(128, 128, 1) + t(128, 256, 1))
    assert COST.recompute_time(0) == 0
    # On 1,000 cached tokens, a 200-token prefill: 128 (reads 1,128), then 72 (reads 1,200).
    assert COST.prefill_time(200, 1000) == pytest.approx(t(128, 1128, 1) + t(72, 1200, 1))


def test_decode_steps_read_one_more_token_per_sequence_each():
    # 3 sequences, 500 context tokens read at the first step: 500, 503, 506, 509.
    assert COST.decode_time(500, 4, 3) == pytest.approx(sum(t(3, 500 + 3 * i, 3) for i in range(4)))
    assert COST.decode_time(500, 0) == 0


def test_negative_terms_are_refused():
    with pytest.raises(ValueError, match="seconds_per_context_token"):
        CostModel(A, C, 128, 1.0, seconds_per_context_token=-1e-9)
    with pytest.raises(ValueError, match="seconds_per_sequence"):
        CostModel(A, C, 128, 1.0, seconds_per_sequence=-1e-9)


# --- the simulator ---------------------------------------------------------------------


def test_a_lone_request_pays_its_context_reads_and_its_sequence():
    # 100-token prompt, 20 tokens out: one prefill (reads 100) samples the first token, then 19
    # decode steps read 101, 102, ..., 119 tokens.
    _, result, _ = _run([single("R", 0.0, 100, 20)], make_policy("preserve", COST), _profile())
    expected = t(100, 100, 1) + sum(t(1, 101 + i, 1) for i in range(19))
    (record,) = result.records
    assert record.e2e_s == pytest.approx(expected, rel=1e-12)
    assert record.isolated_e2e_s == pytest.approx(expected, rel=1e-12)
    # Dropping b would take 19 decode reads (2,090 tokens) and the prefill's 100 off: 4.4 ms.
    assert abs(expected - (t(100, 0, 1) + 19 * t(1, 0, 1))) > 4e-3


def test_two_decoding_requests_pay_two_sequences_and_both_contexts():
    # Both prompts arrive at once and prefill together (64 + 32 tokens, 2 sequences, reads 96);
    # then both decode: step i reads (65 + i) + (33 + i) tokens with 2 sequences, for 9 steps.
    _, result, events = _run([single("A", 0.0, 64, 10), single("B", 0.0, 32, 10)], make_policy("preserve", COST),
                             _profile())
    expected = t(96, 96, 2) + sum(t(2, 98 + 2 * i, 2) for i in range(9))
    assert result.end_s == pytest.approx(expected, rel=1e-12)
    stretch = [e for e in events if e["event"] == "schedule"][1]
    assert (stretch["iterations"], stretch["context_tokens"], stretch["batch"]) == (9, 98, 2)
    assert stretch["span_s"] == pytest.approx(expected - t(96, 96, 2), rel=1e-12)


def test_isolated_latency_after_a_call_reads_the_context_kept_from_before_it():
    # 40-token prompt, 5 out, a call returning 3, then 4 out. Segment 2 starts at 40 + 5 + 3 = 48
    # tokens: the 4 not computed (the last sampled token and the return) prefill on 44 cached ones.
    request = two_segment("R", 0.0, 40, 5, 0.5, 3, 4)
    expected = (t(40, 40, 1) + sum(t(1, 41 + i, 1) for i in range(4)) + 0.5
                + t(4, 48, 1) + sum(t(1, 49 + i, 1) for i in range(3)))
    assert isolated_latency(request, COST) == pytest.approx(expected, rel=1e-12)


# The fast-forward scenarios of `test_engine_semantics`, run again on an engine whose decode
# iterations grow longer each step: the stretch's time is an arithmetic series, not N·dt.
_SCENARIOS = {
    "arrival": (lambda: [single("H", 0.0, 60, 40), single("X", 0.1234, 20, 10)], _profile(), "mars", "arrive"),
    "call return": (lambda: [single("H", 0.0, 60, 40), two_segment("A", 0.0, 20, 5, 0.0777, 3, 10)], _profile(),
                    "preserve", "api_end"),
    "blocks run out": (lambda: [single("A", 0.0, 40, 30), single("B", 0.001, 30, 30)], _profile(6),
                       "preserve", "preempt"),
    "many arrivals": (lambda: [single(f"R{i}", 0.037 * i, 50 + 7 * i, 25 + 3 * i) for i in range(12)], _profile(),
                      "mars", "arrive"),
}


# Reads dominate: H and G read 100-200 tokens a step at 20 µs each on a 1 ms fixed cost, so each step
# is about 1% longer than the one before; counting a stretch as N·dt would run an iteration past the
# next arrival (X finish within two steps, so the arrivals are what ends each stretch).
_HEAVY = CostModel(seconds_per_token=0.0, seconds_per_iteration=0.001, token_budget=128, swap_tokens_per_s=20_000,
                   seconds_per_context_token=2e-5, seconds_per_sequence=1e-4)
_SCENARIOS["arrivals, heavy reads"] = (
    lambda: [single("H", 0.0, 60, 80), single("G", 0.0, 90, 70)] + [single(f"X{i}", 0.05 + 0.0731 * i, 10, 2)
                                                                     for i in range(6)],
    Profile("heavy", "test engine, reads dominate", 1.0, 64, 64, 16, _HEAVY), "preserve", "arrive")


def _without_key(event: dict) -> dict:
    return {k: v for k, v in event.items() if k not in ("score", "key_basis")}


@pytest.mark.parametrize("scenario", list(_SCENARIOS))
def test_fast_forward_with_growing_iterations_matches_one_at_a_time(scenario):
    workload, profile, policy, event = _SCENARIOS[scenario]
    _, fast, fast_events = _run(workload(), make_policy(policy, profile.cost), profile)
    _, slow, slow_events = _run(workload(), make_policy(policy, profile.cost), profile, simulator=_OneIterationAtATime)
    assert fast.steps < fast.iterations and slow.steps == slow.iterations
    assert any(e["event"] == event for e in fast_events)
    assert fast.iterations == slow.iterations
    assert fast.end_s == pytest.approx(slow.end_s, abs=1e-9)
    # Queue keys are refreshed once per scheduling step, so an admit's score and the load it
    # was computed from follow the step cadence; which request is admitted when does not.
    fast_trace = [_without_key(e) for e in fast_events if e["event"] != "schedule"]
    slow_trace = [_without_key(e) for e in slow_events if e["event"] != "schedule"]
    assert len(fast_trace) == len(slow_trace)
    for fast_event, slow_event in zip(fast_trace, slow_trace):
        assert _same(fast_event, slow_event), (fast_event, slow_event)
    for fast_record, slow_record in zip(fast.records, slow.records):
        assert _same(dataclasses.asdict(fast_record), dataclasses.asdict(slow_record)), (fast_record, slow_record)
    # The total busy time is the same sum either way.
    busy = lambda events: sum(e["span_s"] for e in events if e["event"] == "schedule")  # noqa: E731
    assert busy(fast_events) == pytest.approx(busy(slow_events), abs=1e-9)


# --- profiles ----------------------------------------------------------------------------


def _gptj() -> dict:
    return json.loads((files("marsched.sim") / "profiles" / "gptj-6b-a100.json").read_text())


def test_profile_terms_are_optional_and_in_their_units():
    data = _gptj()
    data.pop("iteration_us_per_context_token", None)
    data.pop("iteration_ms_per_sequence", None)
    linear = profile_from_dict(data, "old.json").cost
    assert (linear.seconds_per_context_token, linear.seconds_per_sequence) == (0.0, 0.0)
    data.update(iteration_us_per_context_token=0.25, iteration_ms_per_sequence=0.1)
    cost = profile_from_dict(data, "new.json").cost
    assert cost.seconds_per_context_token == pytest.approx(0.25e-6)
    assert cost.seconds_per_sequence == pytest.approx(0.1e-3)


@pytest.mark.parametrize("field", ["iteration_us_per_context_token", "iteration_ms_per_sequence"])
@pytest.mark.parametrize("value", [-0.1, "0.1", None, True, float("nan")])
def test_a_bad_term_names_the_file_and_the_field(field, value):
    data = _gptj()
    data[field] = value
    with pytest.raises(ValueError, match=rf"my\.json: field '{field}' must be"):
        profile_from_dict(data, "my.json")


def test_bundled_gpu_profiles_carry_both_terms_with_sources():
    for name in ("gptj-6b-a100", "vicuna-13b-2xa100"):
        data = json.loads((files("marsched.sim") / "profiles" / f"{name}.json").read_text())
        for field in ("iteration_us_per_context_token", "iteration_ms_per_sequence"):
            assert data[field] > 0, (name, field)
            assert len(data[f"{field}_source"]) > 40, (name, field)


def test_one_decode_step_is_one_iteration():
    assert COST.decode_time(500, 1) == pytest.approx(COST.iteration_time(1, 500, 1))
    assert COST.decode_time(500, 1, 3) == pytest.approx(COST.iteration_time(3, 500, 3))

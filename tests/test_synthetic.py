"""Synthetic multi-API requests: ranges, mix, determinism, defaults taken from the bundled trace."""

from collections import Counter, defaultdict

import pytest

from marsched.workload import (
    DEFAULT_PROFILES,
    DEFAULT_PROMPT_TOKENS,
    ApiType,
    ApiTypeProfile,
    load_trace,
    synthetic_requests,
)

MIX = {ApiType.MATH: 3.0, ApiType.QA: 1.0, ApiType.CHATBOT: 0.0}


def test_deterministic_per_seed():
    assert synthetic_requests(50, MIX, seed=11) == synthetic_requests(50, MIX, seed=11)
    assert synthetic_requests(50, MIX, seed=11) != synthetic_requests(50, MIX, seed=12)


def test_every_value_is_inside_its_range():
    requests = synthetic_requests(300, MIX, seed=1, calls_per_request=(1, 4), prompt_tokens=(100, 200))
    assert [r.request_id for r in requests] == [f"syn-{i}" for i in range(300)]
    assert {r.num_calls for r in requests} == {1, 2, 3, 4}
    for request in requests:
        assert 100 <= request.prompt_tokens <= 200
        for before, after in zip(request.segments, request.segments[1:]):
            profile = DEFAULT_PROFILES[before.api.api_type]
            assert profile.duration_s[0] <= before.api.duration_s <= profile.duration_s[1]
            assert profile.return_tokens[0] <= before.api.return_tokens <= profile.return_tokens[1]
            assert profile.output_tokens[0] <= before.output_tokens <= profile.output_tokens[1]
            assert after.context_tokens == before.context_at_call + before.api.return_tokens
        last_profile = DEFAULT_PROFILES[request.segments[-2].api.api_type]
        assert last_profile.output_tokens[0] <= request.segments[-1].output_tokens <= last_profile.output_tokens[1]


def test_mix_proportions():
    requests = synthetic_requests(1000, MIX, seed=3, calls_per_request=(2, 2))
    counts = Counter(s.api.api_type for r in requests for s in r.segments if s.api is not None)
    assert set(counts) == {ApiType.MATH, ApiType.QA}  # zero weight never drawn
    assert counts[ApiType.MATH] / 2000 == pytest.approx(0.75, abs=0.03)


def test_zero_calls_gives_single_segment_requests():
    requests = synthetic_requests(20, {ApiType.TTS: 1.0}, seed=0, calls_per_request=(0, 0))
    assert all(r.num_calls == 0 for r in requests)
    assert all(5 <= r.output_tokens <= 117 for r in requests)


def test_custom_profile_for_other():
    profile = ApiTypeProfile(ApiType.OTHER, duration_s=(1.0, 1.0), return_tokens=(3, 3), output_tokens=(2, 2))
    (request,) = synthetic_requests(1, {ApiType.OTHER: 1.0}, seed=0, profiles={ApiType.OTHER: profile},
                                    calls_per_request=(1, 1), prompt_tokens=(10, 10))
    assert request.segments[0].api.duration_s == 1.0
    assert request.segments[1].context_tokens == 10 + 2 + 3


def test_defaults_are_the_bundled_trace_ranges():
    observed = defaultdict(lambda: defaultdict(list))
    for request in load_trace("bundled"):
        segment = request.segments[0]
        values = observed[segment.api.api_type]
        values["duration_s"].append(segment.api.duration_s)
        values["return_tokens"].append(segment.api.return_tokens)
        values["output_tokens"].append(segment.output_tokens)
    assert set(observed) == set(DEFAULT_PROFILES)
    for api_type, values in observed.items():
        profile = DEFAULT_PROFILES[api_type]
        for field in ("return_tokens", "output_tokens"):
            assert getattr(profile, field) == (min(values[field]), max(values[field])), (api_type, field)
        low, high = profile.duration_s
        seen_low, seen_high = min(values["duration_s"]), max(values["duration_s"])
        assert low <= seen_low and high >= seen_high, api_type
        assert seen_low - low <= 1e-3 * max(seen_high, 1e-3) and high - seen_high <= 1e-3 * seen_high, api_type
    token_prompts = [r.prompt_tokens for r in load_trace("bundled") if r.segments[0].api.api_type in
                     {ApiType.MATH, ApiType.VE, ApiType.QA}]
    assert DEFAULT_PROMPT_TOKENS == (min(token_prompts), max(token_prompts))


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"n": -1}, "n must be"),
        ({"mix": {}}, "positive weight"),
        ({"mix": {ApiType.MATH: 0.0}}, "positive weight"),
        ({"mix": {ApiType.MATH: -1.0}}, "MATH|math"),
        ({"mix": {ApiType.MATH: float("nan")}}, "math"),
        ({"mix": {"math": 1.0}}, "not an ApiType"),
        ({"mix": {ApiType.OTHER: 1.0}}, "no profile"),
        ({"calls_per_request": (3, 1)}, "calls_per_request"),
        ({"prompt_tokens": (-1, 5)}, "prompt_tokens"),
        ({"prompt_tokens": (1.5, 5)}, "prompt_tokens"),
    ],
)
def test_validation(arguments, message):
    with pytest.raises(ValueError, match=message):
        synthetic_requests(**{"n": 3, "mix": MIX, "seed": 0, **arguments})


def test_profile_validation():
    with pytest.raises(ValueError, match="duration_s"):
        ApiTypeProfile(ApiType.QA, duration_s=(2.0, 1.0), return_tokens=(1, 2), output_tokens=(1, 2))
    with pytest.raises(ValueError, match="return_tokens"):
        ApiTypeProfile(ApiType.QA, duration_s=(1.0, 2.0), return_tokens=(5, 2), output_tokens=(1, 2))

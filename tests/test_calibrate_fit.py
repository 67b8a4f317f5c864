"""The calibration's fits and profile, on synthetic data (no vLLM)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from marsched.bench.calibrate import (
    FAST,
    CalibrationPlan,
    Measurements,
    calibrated_profile,
    fit_measurements,
    samples_from_steps,
)
from marsched.bench.fit import StepSample, fit_iteration_time, fit_line, nonnegative_least_squares
from marsched.bench.model import ModelInfo
from marsched.sim.profile import load_profile, profile_from_dict

C, A, B, D = 2.6e-3, 5e-5, 1.4e-7, 1.0e-4  # seconds: fixed, per new token, per context token, per sequence


def _truth(new: int, ctx: int, seqs: int) -> float:
    return C + A * new + B * ctx + D * seqs


def _grid(noise: float = 0.0, seed: int = 0) -> list[StepSample]:
    rng = np.random.default_rng(seed)
    shapes = [(n, n, 1) for n in (32, 128, 256, 512, 1024, 2048)]
    shapes += [(batch, batch * (length + 1), batch) for batch in (1, 4, 16, 64) for length in (128, 512, 2048)]
    return [StepSample(n, ctx, seqs, _truth(n, ctx, seqs) * (1 + noise * rng.standard_normal()))
            for n, ctx, seqs in shapes]


def test_fit_recovers_known_constants_exactly():
    fit = fit_iteration_time(_grid())
    assert fit.c == pytest.approx(C, rel=1e-6) and fit.a == pytest.approx(A, rel=1e-6)
    assert fit.b == pytest.approx(B, rel=1e-6) and fit.d == pytest.approx(D, rel=1e-6)
    assert fit.quality.r2 == pytest.approx(1.0) and fit.quality.relative_rms < 1e-9
    assert fit.quality.samples == 18


def test_fit_with_noise_stays_close_and_reports_its_error():
    fit = fit_iteration_time(_grid(noise=0.03, seed=1))
    assert fit.c == pytest.approx(C, rel=0.2) and fit.a == pytest.approx(A, rel=0.1)
    assert fit.b == pytest.approx(B, rel=0.1) and fit.d == pytest.approx(D, rel=0.3)
    assert 0.01 < fit.quality.relative_rms < 0.06 and 0.9 < fit.quality.r2 < 1


def test_constants_are_never_negative():
    # Times that fall with context would give b < 0 by plain least squares: b is clamped at 0.
    samples = [StepSample(b, b * ctx, b, 0.01 + 1e-4 * b - 1e-8 * b * ctx) for b in (1, 4, 16) for ctx in (100, 1000)]
    samples += [StepSample(n, n, 1, 0.01 + 1e-5 * n) for n in (64, 512)]
    fit = fit_iteration_time(samples)
    assert min(fit.c, fit.a, fit.b, fit.d) >= 0 and fit.b == 0


def test_nnls_matches_unconstrained_when_that_is_feasible():
    x = np.array([[1, 1.0], [1, 2], [1, 3], [1, 5]])
    y = 0.5 + 2 * x[:, 1]
    assert nonnegative_least_squares(x, y) == pytest.approx([0.5, 2.0])


def test_too_few_samples_fail_clearly():
    with pytest.raises(ValueError, match="5 samples cannot fit 4 constants"):
        fit_iteration_time(_grid()[:5])


def test_decode_alone_cannot_separate_tokens_from_sequences():
    decode_only = [s for s in _grid() if s.new_tokens == s.sequences]
    with pytest.raises(ValueError, match="do not separate the terms"):
        fit_iteration_time(decode_only)


def test_bad_times_are_named():
    samples = _grid()
    samples[3] = StepSample(10, 10, 1, math.nan)
    with pytest.raises(ValueError, match="sample 3: time must be"):
        fit_iteration_time(samples)


def test_line_fit_and_its_limits():
    line = fit_line([1, 2, 4, 8], [1e-4 + 3e-5 * n for n in (1, 2, 4, 8)])
    assert line.slope == pytest.approx(3e-5) and line.intercept == pytest.approx(1e-4)
    with pytest.raises(ValueError, match="at least 3 points at 2 or more"):
        fit_line([4, 4, 4], [1.0, 1.0, 1.0])
    # Noisy copies that get faster with size: a free line would give slope 0 (an infinite link);
    # through the origin the per-block time stays positive.
    falling = fit_line([1, 4, 8], [9e-4, 4e-4, 3e-4], through_origin=True)
    assert falling.intercept == 0 and falling.slope == pytest.approx((9e-4 + 16e-4 + 24e-4) / 81)


def test_plan_checks_name_the_flag():
    CalibrationPlan().check()
    FAST.check()
    with pytest.raises(ValueError, match="--prefill-tokens: give at least two sizes"):
        CalibrationPlan(prefill_tokens=(64, 64)).check()
    with pytest.raises(ValueError, match="--decode-steps 2"):
        CalibrationPlan(decode_steps=2).check()
    with pytest.raises(ValueError, match="--kv-cache-gb"):
        CalibrationPlan(kv_cache_gb=0).check()
    with pytest.raises(ValueError, match="max model length is 1024"):
        CalibrationPlan().check_against(max_model_len=1024, max_tokens=10**7)
    with pytest.raises(ValueError, match="raise --kv-cache-gb"):
        CalibrationPlan().check_against(max_model_len=4096, max_tokens=10_000)


def _step(t: float, tokens: int, seqs: int, prefill: int, ctx: int, s: float) -> dict:
    return {"t": t, "tokens": tokens, "seqs": seqs, "prefill_seqs": prefill, "ctx": ctx, "step_s": s}


def test_samples_from_steps_picks_the_steps_of_each_point():
    steps = [_step(0.1, 64, 1, 1, 64, 0.010), _step(0.2, 64, 1, 1, 64, 0.012), _step(0.3, 64, 1, 1, 64, 0.011),
             _step(1.1, 256, 2, 2, 256, 0.05),  # the decode point's prefill: not a sample, held out
             _step(1.2, 2, 2, 0, 260, 0.004), _step(1.3, 2, 2, 0, 262, 0.006), _step(1.4, 2, 2, 0, 264, 0.005),
             _step(5.0, 1, 1, 0, 9, 0.1)]  # outside every window
    windows = [("prefill", 64, 1, 0.0, 0.35), ("decode", 128, 2, 1.0, 1.5)]
    prefill, decode, rest = samples_from_steps(steps, windows)
    # Attention pairs: a 64-token prefill from empty makes 64·65/2 = 2,080; a decode step one per
    # context token read, 262.
    assert prefill == [StepSample(64, 64, 1, 0.011, 3, attention_pairs=2080)]
    assert decode == [StepSample(2, 262, 2, 0.005, 3, attention_pairs=262)]
    assert [s["tokens"] for s in rest] == [256]


def _measurements() -> Measurements:
    return measurements_of(_grid(noise=0.01))


def measurements_of(samples: list[StepSample]) -> Measurements:
    """A calibration of a small model from these step samples (prefill: one sequence, several new
    tokens; decode: one new token a sequence), with fixed swap times and engine facts."""
    info = ModelInfo("/models/small", 4, 2, 64, "bfloat16", 4096, 32000, "small")
    return Measurements(
        info, prefill=[s for s in samples if s.sequences == 1 and s.new_tokens > 1],
        decode=[s for s in samples if s.new_tokens == s.sequences], swap_out=[(1, 3e-5), (4, 1.1e-4), (16, 4.2e-4)],
        swap_in=[(1, 4e-5), (4, 1.5e-4), (16, 6e-4)],
        engine={"blocks": 2047, "block_tokens": 128, "tokens": 2047 * 128, "max_model_len": 4096,
                "max_num_batched_tokens": 2048, "max_num_seqs": 256, "reserve_full_prompt": True, "kv_bytes_per_token": 2048,
                "kv_cache_gb": 0.5},
        when="2026-11-30T00:00:00Z", seconds=100.0)


def test_calibrated_profile_loads_with_the_measured_capacity(tmp_path):
    m = _measurements()
    data = calibrated_profile(m, fit_measurements(m), "calibrated-test", host_swap_tokens=1 << 20)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    profile = load_profile(str(path))
    assert profile.device_blocks == 2047 and profile.block_tokens == 128 and profile.host_blocks == (1 << 20) // 128
    assert profile.kv_bytes_per_token == 2048
    assert profile.cost.token_budget == 2048
    assert profile.max_sequences == 256 and "max_num_seqs" in data["max_num_seqs_source"]
    assert profile.admits_whole_prompt and "scheduler_reserve_full_isl" in data["admits_whole_prompt_source"]
    assert profile.cost.seconds_per_iteration == pytest.approx(C, rel=0.3)
    assert profile.cost.seconds_per_token == pytest.approx(A, rel=0.1)
    assert data["iteration_us_per_context_token"] == pytest.approx(B * 1e6, rel=0.1)
    assert data["iteration_ms_per_sequence"] == pytest.approx(D * 1e3, rel=0.5)
    # The new terms reach the cost model once it has them (added in parallel to CostModel).
    for field, value in (("seconds_per_context_token", data["iteration_us_per_context_token"] / 1e6),
                         ("seconds_per_sequence", data["iteration_ms_per_sequence"] / 1e3)):
        if hasattr(profile.cost, field):
            assert getattr(profile.cost, field) == pytest.approx(value)
    for key in ("iteration_ms_fixed", "iteration_ms_per_token", "iteration_us_per_context_token",
                "iteration_ms_per_sequence"):
        source = data[f"{key}_source"]
        assert "measured by marsched calibrate" in source and "/models/small" in source and "R²" in source
        assert "relative RMS" in source and "2026-11-30" in source and "samples" in source
    # Swap: 256 KiB per block over the mean of the per-block times (fits through the origin).
    assert data["link_gb_per_s"] == pytest.approx(2048 * 128 / ((2.65e-5 + 3.75e-5) / 2) / 1e9, rel=0.1)
    assert data["swap_out_ms_per_block"] == pytest.approx(0.0265, rel=0.05)


def _base_profile() -> dict:
    return json.loads(json.dumps({
        "name": "t", "model": {"layers": 2, "kv_hidden_size": 64, "dtype_bytes": 2},
        "block_tokens": 16, "token_budget": 256, "iteration_ms_per_token": 0.01, "iteration_ms_fixed": 1.0,
        "link_gb_per_s": 10.0, "device_blocks": 100, "host_blocks": 50}))


def test_profile_capacity_stated_in_blocks_is_validated():
    profile = profile_from_dict(_base_profile(), "p.json")
    assert (profile.device_blocks, profile.host_blocks) == (100, 50)
    for key, value, message in (("device_blocks", 0, "'device_blocks' must be a whole number of blocks >= 1"),
                                ("device_blocks", 2.5, "'device_blocks' must be a whole number"),
                                ("host_blocks", -1, "'host_blocks' must be a whole number of blocks >= 0"),
                                ("gpu_memory_gb", 40, "either 'device_blocks' .* not both"),
                                ("host_swap_gb", 4, "either 'host_blocks' or 'host_swap_gb'")):
        data = _base_profile()
        data[key] = value
        with pytest.raises(ValueError, match=f"p.json: .*{message}"):
            profile_from_dict(data, "p.json")


def test_the_cap_on_running_requests_is_optional_and_validated():
    assert profile_from_dict(_base_profile(), "p.json").max_sequences is None  # written before the field
    data = _base_profile()
    for value in (1, 8):
        data["max_num_seqs"] = value
        assert profile_from_dict(data, "p.json").max_sequences == value
    for value in (0, 2.5, True, "8"):
        data["max_num_seqs"] = value
        with pytest.raises(ValueError, match="p.json: field 'max_num_seqs' must be a whole number of requests >= 1"):
            profile_from_dict(data, "p.json")


def test_whole_prompt_admission_is_optional_and_validated():
    assert not profile_from_dict(_base_profile(), "p.json").admits_whole_prompt  # written before the field
    data = _base_profile()
    data["admits_whole_prompt"] = True
    assert profile_from_dict(data, "p.json").admits_whole_prompt
    for value in (1, "true", None):
        data["admits_whole_prompt"] = value
        with pytest.raises(ValueError, match="p.json: field 'admits_whole_prompt' must be true or false"):
            profile_from_dict(data, "p.json")


def test_bundled_profiles_still_derive_capacity_from_memory():
    profile = load_profile("gptj-6b-a100")
    assert profile.device_blocks > 0 and profile.host_blocks > 0


def test_a_fit_that_zeroes_a_needed_cost_fails_with_why_and_writes_nothing(tmp_path, capsys):
    import typer

    from marsched.bench.commands import loadable_or_fail

    bundled = Path(__file__).resolve().parents[1] / "src" / "marsched" / "sim" / "profiles" / "gptj-6b-a100.json"
    profile = json.loads(bundled.read_text())
    out = tmp_path / "calibrated.json"
    loadable_or_fail(profile, out)  # a usable profile passes
    profile["iteration_ms_per_token"] = 0.0  # what a noisy fit gave on a busy machine
    with pytest.raises(typer.Exit) as stopped:
        loadable_or_fail(profile, out)
    assert stopped.value.exit_code == 2 and not out.exists()
    message = " ".join(capsys.readouterr().err.split())
    assert "iteration_ms_per_token" in message and "too noisy" in message

"""The calibration fits the attention-pair term `e` where its samples determine it, and says so
where they do not (synthetic data, no vLLM)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from marsched.bench.calibrate import calibrated_profile, fit_measurements, held_out_error
from marsched.bench.fit import StepSample, attention_support, fit_iteration_time
from marsched.policy.cost_model import attention_pairs
from marsched.sim.profile import load_profile
from test_calibrate_fit import measurements_of

# Seconds: fixed, per new token, per context token, per sequence, per attention pair.
C, A, B, D, E = 2.6e-3, 5e-5, 1.4e-7, 1.0e-4, 2e-9


def _truth(new: int, ctx: int, seqs: int, pairs: int) -> float:
    return C + A * new + B * ctx + D * seqs + E * pairs


def _grid(prefill_sizes=(32, 128, 256, 512, 1024, 2048), noise: float = 0.0, with_pairs: bool = True) -> list[StepSample]:
    """Prefill of N from empty (N(N+1)/2 pairs) and decode of B sequences at L (pairs = reads)."""
    rng = np.random.default_rng(0)
    shapes = [(n, n, 1, attention_pairs(n, 0)) for n in prefill_sizes]
    shapes += [(b, b * (length + 1), b, b * (length + 1)) for b in (1, 4, 16, 64) for length in (128, 512, 2048)]
    return [StepSample(n, ctx, seqs, _truth(n, ctx, seqs, pairs) * (1 + noise * rng.standard_normal()), 1,
                       pairs if with_pairs else 0)
            for n, ctx, seqs, pairs in shapes]


def test_the_five_constants_are_recovered_exactly():
    fit = fit_iteration_time(_grid())
    assert fit.attention == "fitted"
    for got, want in ((fit.c, C), (fit.a, A), (fit.b, B), (fit.d, D), (fit.e, E)):
        assert got == pytest.approx(want, rel=1e-6)
    assert fit.quality.relative_rms < 1e-9
    # 2,048 tokens: 2,098,176 pairs, 4.2 ms of the 108 ms step, which the prediction includes.
    assert fit.predict(2048, 2048, 1, 2_098_176) == pytest.approx(_truth(2048, 2048, 1, 2_098_176), rel=1e-6)
    assert fit.predict(2048, 2048, 1) == pytest.approx(_truth(2048, 2048, 1, 0), rel=1e-6)


def test_with_noise_e_stays_close():
    fit = fit_iteration_time(_grid(noise=0.01))
    assert fit.attention == "fitted" and fit.e == pytest.approx(E, rel=0.3)


def test_samples_without_pairs_fit_four_terms_and_say_why():
    samples = _grid(with_pairs=False)
    assert attention_support(samples) == "not fitted: the samples carry no attention pairs"
    fit = fit_iteration_time(samples)
    assert fit.e == 0 and fit.attention == "not fitted: the samples carry no attention pairs"


def test_one_prefill_size_cannot_separate_e():
    # Decode steps pair what they read, so they only give b + e; one prefill size adds a single
    # equation in d, a + b and e: not enough. A second size is.
    samples = _grid(prefill_sizes=(512,))
    assert attention_support(samples) == ("not fitted: the attention pairs do not vary apart from the other terms "
                                          "(prefill of two or more sizes separates them)")
    fit = fit_iteration_time(samples)
    assert fit.e == 0 and fit.attention == attention_support(samples)
    assert attention_support(_grid(prefill_sizes=(256, 1024))) is None


def test_too_few_samples_for_five_constants_fit_four():
    grid = _grid()
    samples = grid[:3] + [grid[6], grid[10], grid[14]]  # 3 prefill sizes, decode at 1×128, 4×512, 16×2048
    assert attention_support(samples) == "not fitted: 6 samples, and five constants need 7"
    fit = fit_iteration_time(samples)
    assert fit.e == 0 and fit.attention == attention_support(samples)
    assert attention_support(samples + [grid[7]]) is None


def test_the_profile_carries_the_fitted_e_and_its_source(tmp_path):
    m = measurements_of(_grid())
    data = calibrated_profile(m, fit_measurements(m), "calibrated-test", host_swap_tokens=1 << 20)
    assert data["iteration_ns_per_attention_pair"] == pytest.approx(E * 1e9, rel=1e-5)
    source = data["iteration_ns_per_attention_pair_source"]
    assert "measured by marsched calibrate" in source and "e·attention_pairs" in source and "R²" in source
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    assert load_profile(str(path)).cost.seconds_per_attention_pair == pytest.approx(E, rel=1e-5)


def test_the_profile_says_when_e_was_not_fitted():
    m = measurements_of(_grid(prefill_sizes=(512,)))
    data = calibrated_profile(m, fit_measurements(m), "calibrated-test", host_swap_tokens=1 << 20)
    assert data["iteration_ns_per_attention_pair"] == 0
    assert data["iteration_ns_per_attention_pair_source"].startswith("e = 0, not fitted: the attention pairs do not vary")
    assert "e·attention_pairs" not in data["iteration_source"]


def test_held_out_steps_are_predicted_with_their_pairs():
    fit = fit_iteration_time(_grid())
    # A mixed step: a 512-token chunk on 1,536 cached (pairs 512·1,536 + 512·513/2 = 917,760) and 3 decodes at 100.
    pairs = 917_760 + 303
    step = {"tokens": 515, "ctx": 2048 + 303, "seqs": 4, "pairs": pairs, "step_s": _truth(515, 2351, 4, pairs)}
    assert held_out_error(fit, [step])["median_relative_error"] == pytest.approx(0.0, abs=1e-6)
    # A step log without pairs (written before they were logged) is predicted without them: 1.8 ms short.
    old = {k: v for k, v in step.items() if k != "pairs"}
    assert held_out_error(fit, [old])["median_relative_error"] > 0.01


def test_the_step_log_counts_each_sequences_pairs_on_its_cached_tokens(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from marsched.bench import steps

    class Engine:
        """What the timer needs of a vLLM scheduler: `requests` and the three calls it wraps."""

        def __init__(self) -> None:
            # After `schedule()`, vLLM counts the scheduled tokens as computed: a's 128 on 1,000, b's 1 on 100.
            self.requests = {"a": SimpleNamespace(num_computed_tokens=1128), "b": SimpleNamespace(num_computed_tokens=101)}

        def schedule(self):
            return SimpleNamespace(num_scheduled_tokens={"a": 128, "b": 1}, total_num_scheduled_tokens=129)

        def update_from_output(self, scheduler_output, model_runner_output):
            return None

        def shutdown(self) -> None:
            pass

    class Timed(steps.StepTimerMixin, Engine):
        pass

    log = tmp_path / "steps.jsonl"
    monkeypatch.setenv(steps.ENV_VAR, str(log))
    timed = Timed()
    timed.update_from_output(timed.schedule(), None)
    timed.shutdown()
    (line,) = [json.loads(text) for text in log.read_text().splitlines()]
    # a: 128·1,000 + 128·129/2 = 136,256; b: a decode step on 100, 101 pairs.
    assert (line["tokens"], line["seqs"], line["prefill_seqs"], line["ctx"], line["pairs"]) == (129, 2, 1, 1229, 136_357)

"""The cost model a server learns by itself (`marsched.policy.learned_cost`): pure, on synthetic steps."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest

from marsched.experiments.twin.step_log import KINDS, fitted_terms, priced, read_steps
from marsched.policy.cost_model import CostModel, attention_pairs
from marsched.policy.learned_cost import (
    STEP_TERM_NAMES, CostSource, LearnedCost, LearnSettings, StepShape, StepTimeFit, StepWeight, SwapRateFit, terms_of,
)

PLACEHOLDER = CostModel(2e-5, 0.01, 2048, 1e6)
TRUE = (4e-3, 1.5e-4, 2e-7, 3e-4, 5e-8)  # c, a, b, d, e: far from the placeholders


def _served_steps(count: int, rng: random.Random) -> list[StepShape]:
    """Steps like a server's: mostly decode batches of varying size and context, some prefills."""
    shapes = []
    for _ in range(count):
        if rng.random() < 0.2:  # a prefill chunk, maybe beside a few decoding sequences
            n, cached, decoding = rng.randint(16, 1024), rng.choice([0, 0, 256]), rng.randint(0, 4)
            contexts = [rng.randint(32, 2048) for _ in range(decoding)]
            shapes.append(StepShape(n + decoding, cached + n + sum(contexts), 1 + decoding,
                                    attention_pairs(n, cached) + sum(contexts)))
        else:
            contexts = [rng.randint(32, 2048) for _ in range(rng.randint(1, 32))]
            shapes.append(StepShape(len(contexts), sum(contexts), len(contexts), sum(contexts)))
    return shapes


def _time(terms: tuple[float, ...], shape: StepShape) -> float:
    return sum(t * x for t, x in zip(terms, shape.row()))


def test_recovers_known_constants_from_noisy_steps():
    rng = random.Random(0)
    fit = StepTimeFit(terms_of(PLACEHOLDER))
    for shape in _served_steps(3000, rng):
        fit.observe(shape, _time(TRUE, shape) * math.exp(rng.gauss(0, 0.05)))  # 5% noise
    c, a, b, d, e = fit.fit()
    assert fit.learned
    assert c == pytest.approx(TRUE[0], rel=0.1)
    assert a == pytest.approx(TRUE[1], rel=0.1)
    assert d == pytest.approx(TRUE[3], rel=0.15)
    assert e == pytest.approx(TRUE[4], rel=0.15)
    assert b == pytest.approx(TRUE[2], abs=1e-7)  # small beside d's and e's share of a decode step
    # What the ranking sees: a decode step of 16 sequences at 1k context, a 512-token prefill.
    for shape in (StepShape(16, 16_384, 16, 16_384), StepShape(512, 512, 1, attention_pairs(512, 0))):
        assert _time(fit.terms, shape) == pytest.approx(_time(TRUE, shape), rel=0.03)


def test_stays_at_the_prior_with_too_few_steps():
    settings = LearnSettings(min_steps=32)
    learned = LearnedCost(PLACEHOLDER, CostSource.PLACEHOLDER, CostSource.PLACEHOLDER, settings)
    rng = random.Random(1)
    for shape in _served_steps(31, rng):
        assert not learned.observe_step(shape, _time(TRUE, shape))
    assert learned.cost == PLACEHOLDER
    assert learned.snapshot()["step_source"] == "placeholder"
    assert learned.snapshot()["steps"] == 31
    shape = _served_steps(1, rng)[0]
    assert learned.observe_step(shape, _time(TRUE, shape))  # the 32nd: the fit takes over
    assert learned.snapshot()["step_source"] == "learned"
    assert learned.cost.seconds_per_iteration != PLACEHOLDER.seconds_per_iteration


def test_early_estimates_are_not_wild():
    """One step shape only (a lone request decoding): the traffic does not separate c, a, d, b and e,
    so the fit predicts that shape well and moves the rest no further than the prior lets it."""
    fit = StepTimeFit(terms_of(PLACEHOLDER), LearnSettings(min_steps=8))
    for i in range(100):
        shape = StepShape(1, 100 + i % 40, 1, 100 + i % 40)
        fit.observe(shape, _time(TRUE, shape))
    assert _time(fit.terms, StepShape(1, 120, 1, 120)) == pytest.approx(_time(TRUE, StepShape(1, 120, 1, 120)), rel=0.05)
    assert all(t >= 0 for t in fit.terms)
    assert all(t < 0.1 for t in fit.terms)  # nothing swings past a tenth of a second


def test_the_prior_holds_what_the_steps_do_not_separate():
    """Decode steps only: one token per sequence, so `a` and `d` always come together. The steps fix
    their sum; the prior, their difference (the placeholders': 2e-5 − 0)."""
    fit = StepTimeFit(terms_of(PLACEHOLDER), LearnSettings(min_steps=8))
    rng = random.Random(5)
    for _ in range(300):
        contexts = [rng.randint(32, 2048) for _ in range(rng.randint(1, 32))]
        shape = StepShape(len(contexts), sum(contexts), len(contexts), sum(contexts))
        fit.observe(shape, _time(TRUE, shape) * math.exp(rng.gauss(0, 0.05)))
    c, a, b, d, e = fit.fit()
    assert a + d == pytest.approx(TRUE[1] + TRUE[3], rel=0.2)
    assert _time((c, a, b, d, e), StepShape(16, 16_384, 16, 16_384)) == pytest.approx(
        _time(TRUE, StepShape(16, 16_384, 16, 16_384)), rel=0.03)
    assert a - d == pytest.approx(PLACEHOLDER.seconds_per_token - PLACEHOLDER.seconds_per_sequence, abs=1e-6)


def test_constants_are_never_negative():
    fit = StepTimeFit(terms_of(PLACEHOLDER), LearnSettings(min_steps=4))
    rng = random.Random(2)
    for shape in _served_steps(200, rng):  # time falls with context: an unconstrained b would be < 0
        fit.observe(shape, max(0.02 + 1e-4 * shape.tokens - 1e-7 * shape.context_tokens, 1e-3))
    assert all(t >= 0 for t in fit.terms)


def test_a_passed_profile_or_constants_are_never_overridden():
    profile = CostModel(1e-4, 5e-3, 2048, 3e5, seconds_per_context_token=1e-8)
    for source in (CostSource.PROFILE, CostSource.CONFIGURED):
        learned = LearnedCost(profile, source, source, LearnSettings(min_steps=1, min_swap_blocks=1))
        assert not learned.learning
        for shape in _served_steps(100, random.Random(3)):
            assert not learned.observe_step(shape, _time(TRUE, shape))
        assert not learned.observe_copies(64, 64 * 16, 0.01)
        assert learned.cost == profile
        snap = learned.snapshot()
        assert (snap["step_source"], snap["swap_source"], snap["steps"]) == (source.value, source.value, 0)


def test_swap_rate_from_measured_copies():
    learned = LearnedCost(PLACEHOLDER, CostSource.CONFIGURED, CostSource.PLACEHOLDER, LearnSettings(min_swap_blocks=4))
    assert not learned.observe_copies(2, 32, 0.001)  # 2 blocks: too few
    assert learned.cost.swap_tokens_per_s == 1e6
    assert learned.observe_copies(6, 96, 0.009)
    assert learned.cost.swap_tokens_per_s == pytest.approx(128 / 0.01)
    assert learned.snapshot()["swap_source"] == "learned"
    assert learned.snapshot()["step_source"] == "configured"
    assert learned.cost.seconds_per_token == PLACEHOLDER.seconds_per_token  # the step terms as given


def test_the_whole_runs_fit_forgets_nothing_and_is_only_reported():
    """The fit decided with weighs the last `memory_steps` steps; `run` weighs the whole run, each step by its time."""
    rng = random.Random(4)
    learned = LearnedCost(PLACEHOLDER, CostSource.PLACEHOLDER, CostSource.PLACEHOLDER, LearnSettings(memory_steps=1024))
    slower = tuple(2 * t for t in TRUE)
    shapes = _served_steps(8000, rng)
    for i, shape in enumerate(shapes):  # the engine's steps take twice as long for the second half
        learned.observe_step(shape, _time(TRUE if i < 4000 else slower, shape))
    reference = StepShape(512, 512, 1, attention_pairs(512, 0))
    run = learned.snapshot()["run"]
    assert run["steps"] == 8000
    run_time = _time(tuple(run[name] for name in STEP_TERM_NAMES), reference)
    assert _time(terms_of(learned.cost), reference) == pytest.approx(_time(slower, reference), rel=0.05)
    # Both halves count, the slower one more: its steps hold two thirds of the time (one number over
    # both halves would be 4/3 of the faster weighed by time, 6/5 weighed alike).
    assert 1.27 < run_time / _time(TRUE, reference) < 1.45
    # Decisions use the latest fit only: the reported run never enters the cost model.
    assert learned.cost.seconds_per_iteration == pytest.approx(learned.step.terms[0])
    assert run["seconds_per_iteration"] != pytest.approx(learned.cost.seconds_per_iteration, rel=0.05)


def test_weighing_by_time_counts_a_step_once_per_millisecond():
    """A fit weighed by time is the fit weighed alike of the same steps, each repeated as many times as
    it took milliseconds (up to the prior, a few steps' worth in both); on times the form cannot fit
    exactly, it is not the fit weighed alike."""
    rng = random.Random(6)
    steps = []
    for shape in _served_steps(1000, rng):  # whole milliseconds, 30% off the form either way
        steps.append((shape, max(round(1000 * _time(TRUE, shape) * rng.uniform(0.7, 1.3)), 1)))
    whole = LearnSettings(memory_steps=math.inf)  # the repeats would otherwise forget more
    by_time = StepTimeFit(terms_of(PLACEHOLDER), whole, StepWeight.TIME)
    alike, repeated = StepTimeFit(terms_of(PLACEHOLDER), whole), StepTimeFit(terms_of(PLACEHOLDER), whole)
    for shape, ms in steps:
        by_time.record(shape, ms / 1000)
        alike.record(shape, ms / 1000)
        for _ in range(ms):
            repeated.record(shape, ms / 1000)
    probe = [shape for shape, _ in steps[:200]]

    def probe_times(fit: StepTimeFit) -> list[float]:
        return [_time(fit.fit(), shape) for shape in probe]

    assert probe_times(by_time) == pytest.approx(probe_times(repeated), rel=0.02)
    assert probe_times(by_time) != pytest.approx(probe_times(alike), rel=0.01)


def test_the_whole_run_of_a_logged_server_is_priced_where_its_time_is():
    """A live host-tier server's step log at a queueing load (results/twin/run10/step-logs): 7,382
    decode steps and 572 chunks of 2,048 tokens or more, which hold about half its time. Weighed alike,
    the fit priced those chunks at 1.17× their time; the whole run's fit, weighed by time, within 5%."""
    steps = read_steps(Path(__file__).parents[1] / "results/twin/run10/step-logs/host.steps.jsonl")
    rows = {row.kind: row for row in priced(steps, fitted_terms(steps, 4096))}
    long_chunks, everything = rows[KINDS[3]], rows["all"]
    assert long_chunks.priced_s["whole run"] / long_chunks.measured_s == pytest.approx(1.0, abs=0.05)
    assert long_chunks.priced_s["latest"] / long_chunks.measured_s > 1.1  # the fit decided with, weighed alike
    assert everything.priced_s["whole run"] / everything.measured_s == pytest.approx(1.0, abs=0.07)


def test_the_whole_runs_fit_is_reported_once_learned_and_only_where_steps_are_learned():
    learned = LearnedCost(PLACEHOLDER, CostSource.PLACEHOLDER, CostSource.PLACEHOLDER, LearnSettings(min_steps=32))
    shapes = _served_steps(32, random.Random(5))
    for shape in shapes[:31]:
        learned.observe_step(shape, _time(TRUE, shape))
    assert learned.snapshot()["run"] is None
    learned.observe_step(shapes[31], _time(TRUE, shapes[31]))
    assert learned.snapshot()["run"]["steps"] == 32
    profiled = LearnedCost(PLACEHOLDER, CostSource.PROFILE, CostSource.PLACEHOLDER)
    for shape in shapes:
        profiled.observe_step(shape, _time(TRUE, shape))
    assert profiled.snapshot()["run"] is None


def test_memory_may_be_the_whole_run():
    assert LearnSettings(memory_steps=math.inf).memory_steps == math.inf
    with pytest.raises(ValueError, match="memory_steps"):
        LearnSettings(memory_steps=math.nan)
    with pytest.raises(ValueError, match="memory_steps"):
        LearnSettings(memory_steps=0.5)


def test_bad_input_is_named():
    fit = StepTimeFit(terms_of(PLACEHOLDER))
    with pytest.raises(ValueError, match="finite number > 0"):
        fit.observe(StepShape(1, 1, 1), 0.0)
    with pytest.raises(ValueError, match="counts must be >= 0"):
        fit.observe(StepShape(-1, 1, 1), 0.01)
    with pytest.raises(ValueError, match="min_steps"):
        LearnSettings(min_steps=0)
    with pytest.raises(ValueError, match="prior"):
        StepTimeFit((1.0, -1.0, 0, 0, 0))
    with pytest.raises(ValueError, match="swap-rate prior"):
        SwapRateFit(0.0)


# --- where the plugin's cost model comes from, and how a step is timed ------------------------------


def test_config_says_which_parts_are_learned():
    from marsched.vllm.config import CostSettings, MarsConfig

    assert MarsConfig().cost_sources() == (CostSource.PLACEHOLDER, CostSource.PLACEHOLDER)
    assert MarsConfig(profile="llama3-8b-h100").cost_sources() == (CostSource.PROFILE, CostSource.PROFILE)
    assert MarsConfig(cost=CostSettings(seconds_per_token=1e-4)).cost_sources() == (
        CostSource.CONFIGURED, CostSource.PLACEHOLDER)
    assert MarsConfig(cost=CostSettings(swap_tokens_per_s=5e5)).cost_sources() == (
        CostSource.PLACEHOLDER, CostSource.CONFIGURED)
    assert MarsConfig(cost=CostSettings(token_budget=512)).cost_sources() == (
        CostSource.PLACEHOLDER, CostSource.PLACEHOLDER)  # the budget is not a cost
    with pytest.raises(ValueError, match="learn_cost"):
        MarsConfig(learn_cost="yes")
    off = LearnedCost(PLACEHOLDER, *MarsConfig(learn_cost=False).cost_sources(), learn=False)
    assert not off.learning and off.snapshot()["step_source"] == "placeholder"


def test_a_profile_passed_to_the_scheduler_is_never_learned_over():
    from marsched.vllm.config import MarsConfig

    config = MarsConfig(profile="llama3-8b-h100")
    cost = config.cost_model(token_budget=2048)
    learned = LearnedCost(cost, *config.cost_sources(), LearnSettings(min_steps=1, min_swap_blocks=1))
    for shape in _served_steps(50, random.Random(4)):
        learned.observe_step(shape, _time(TRUE, shape))
    learned.observe_copies(100, 1600, 0.5)
    assert learned.cost == cost and learned.snapshot()["step_source"] == "profile"


def test_step_clock_counts_the_engine_busy_not_idle():
    from marsched.vllm.step_clock import StepClock

    clock, shape = StepClock(), StepShape(1, 10, 1, 10)
    first, second, third = object(), object(), object()
    clock.scheduled(first, 10.0, shape)
    assert clock.updated(first, 10.5) == (shape, 0.5)
    clock.scheduled(second, 20.0, shape)  # idle from 10.5 to 20: not counted
    assert clock.updated(second, 20.25) == (shape, 0.25)
    # Asynchronous scheduling: the third is scheduled before the second's update; it counts from then.
    clock.scheduled(third, 20.1, shape)
    assert clock.updated(third, 20.45) == (shape, pytest.approx(0.2))
    assert clock.updated(object(), 21.0) is None  # a step that computed nothing was not scheduled here


def test_the_startup_line_says_where_the_cost_model_comes_from():
    from marsched.serve.launch import cost_text
    from marsched.vllm.config import CostSettings, MarsConfig

    assert "step time and swap rate learned" in cost_text(MarsConfig())
    assert cost_text(MarsConfig(profile="llama3-8b-h100")) == "cost model from profile llama3-8b-h100"
    assert "not learned" in cost_text(MarsConfig(learn_cost=False))
    assert cost_text(MarsConfig(cost=CostSettings(seconds_per_token=1e-4, swap_tokens_per_s=3.0))) == "cost model as given"


def test_metrics_show_the_cost_model_and_its_source():
    from prometheus_client.parser import text_string_to_metric_families

    from marsched.serve.metrics import MarsSnapshot, render

    learned = LearnedCost(PLACEHOLDER, CostSource.PLACEHOLDER, CostSource.PROFILE, LearnSettings(min_steps=4))
    for shape in _served_steps(4, random.Random(6)):
        learned.observe_step(shape, _time(TRUE, shape))
    text = render([MarsSnapshot(True, {"cost_model": learned.snapshot()})]).decode()
    values = {(s.name, tuple(sorted(s.labels.items()))): s.value
              for family in text_string_to_metric_families(text) for s in family.samples}
    rank = (("rank", "0"),)
    assert values[("marsched_cost_model_seconds", rank + (("source", "learned"), ("term", "iteration")))] == \
        learned.cost.seconds_per_iteration
    assert values[("marsched_cost_model_seconds", rank + (("source", "learned"), ("term", "token")))] == \
        learned.cost.seconds_per_token
    assert values[("marsched_cost_model_swap_tokens_per_second", rank + (("source", "profile"),))] == 1e6
    assert values[("marsched_cost_model_steps_total", rank)] == 4
    assert "marsched_cost_model" not in render([MarsSnapshot(True, {})]).decode()  # a scheduler without one


def test_a_key_computed_with_a_learned_cost_model_is_recomputed_by_the_audit():
    """The queue keys a request with the cost model of the moment; once the server has learned a new
    one, a refresh keys it anew, its admit's key basis names that model, and the audit recomputes it."""
    from marsched.audit.keys import recompute_key
    from marsched.policy import EngineLoad, WaitingQueue, make_policy
    from marsched.policy.progress import RequestProgress
    from marsched.policy.trace_fields import key_basis
    from marsched.predict.segment import SegmentPrediction
    from marsched.workload.model import build_request

    policy = make_policy("mars", PLACEHOLDER)
    declared = policy.cost
    queue = WaitingQueue(policy)
    progress = RequestProgress(build_request("r", 300, [(20, None)]), order_s=0.0,
                               predictions=[SegmentPrediction(20, 0.0, 0, False)])
    queue.push(progress, EngineLoad(0.0, 0, 0.05, 0), 1)
    before = next(iter(queue._entries.values())).key
    policy.cost = CostModel(6e-5, 4.8e-3, 2048, 2.7e6, seconds_per_sequence=1.9e-4)  # learned
    assert queue.refresh(EngineLoad(1.0, 0, 0.01, 0), 2)
    assert queue.pop(2, 1.0) is progress
    assert progress.left_key != pytest.approx(before)
    basis = key_basis(progress, declared)
    assert basis["cost"]["seconds_per_iteration"] == 4.8e-3
    audit_policy = make_policy("mars", declared)
    assert recompute_key(audit_policy, basis) == pytest.approx(progress.left_key)
    assert audit_policy.cost is declared  # the audit's policy keeps the run's model
    assert "cost" not in key_basis(progress, policy.cost)  # the run's own model is not repeated

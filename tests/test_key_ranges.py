"""The waiting queue's fast path: a key that follows the running batch's KV is kept while the
batch stays in the range where its later strategies are the same (`KeyForm.holds_for`), and
the run is the same, to the bit, as one that recomputes such keys at every refresh."""

from __future__ import annotations

import dataclasses
import random

import pytest

from marsched.metrics.records import RequestRecord
from marsched.policy import CostModel, make_policy
from marsched.policy.load import EngineLoad
from marsched.policy.ranking import KeyForm
from marsched.policy.strategy import Strategy
from marsched.policy.waste import call_wastes, cheapest, discard_cheapest_below, first_false
from marsched.sim.profile import load_profile
from marsched.sim.select import make_simulator
from marsched.workload import load_named, poisson_arrivals, scale_tokens
from test_engine_semantics import Recorder
from test_compaction import _progress
from simhelpers import COST


def _discards(context, api_s, batch, cost, kept):
    return cheapest(call_wastes(context, api_s, batch, cost, kept)) is Strategy.DISCARD


@pytest.mark.parametrize("seed", range(4))
def test_the_bound_is_where_cheapest_stops_choosing_discard(seed):
    rng = random.Random(seed)
    cost = CostModel(seconds_per_token=2e-5, seconds_per_iteration=5e-3, token_budget=512, swap_tokens_per_s=3e5,
                     seconds_per_context_token=4e-8, seconds_per_attention_pair=9e-10)
    checked = {"zero": 0, "inner": 0}
    for _ in range(400):
        context = rng.randint(1, 60_000)
        api_s = rng.choice([0.0, 1e-3, 0.05, 0.3, 2.0, 30.0]) * rng.random()
        kept = rng.choice([None, None, rng.randint(0, context)])
        bound = discard_cheapest_below(context, api_s, cost, kept)
        if bound == 0:
            checked["zero"] += 1
            assert not _discards(context, api_s, 0, cost, kept)
            continue
        checked["inner"] += 1
        assert _discards(context, api_s, bound - 1, cost, kept) and not _discards(context, api_s, bound, cost, kept)
        assert _discards(context, api_s, 0, cost, kept)
        assert not _discards(context, api_s, bound + rng.randint(0, 10**6), cost, kept)
    assert checked["zero"] and checked["inner"]


def test_the_bound_by_hand():
    # simhelpers' engine, C = 104 for 30 ms keeping 20: Preserve 3.12, Swap (104² + 20²)/20000 =
    # 0.5608; Discard t(20)·(20 + B) = 0.011·(20 + B) < 0.5608 while B < 30.98: 30 discards, 31 not.
    assert discard_cheapest_below(104, 0.03, COST, kept_tokens=20) == 31
    assert discard_cheapest_below(104, 0.03, COST) == 0  # all 104 back: Swap (1.0816) beats Discard (1.58)
    assert discard_cheapest_below(104, 0.0, COST) == 0  # Preserve is free
    assert discard_cheapest_below(104, 1.0, COST, kept_tokens=0) == float("inf")  # nothing to recompute


@pytest.mark.parametrize("guess", [-5, 0, 1, 10, 36, 37, 38, 100])
def test_the_search_settles_a_guess_that_is_off(guess):
    assert first_false(lambda n: n < 37, guess) == 37
    assert first_false(lambda n: n < 1, guess) == 1


def test_a_form_holds_only_in_its_range():
    form = KeyForm(1.0, 2.0, True, 10, 20)
    assert [form.holds_for(b) for b in (9, 10, 19, 20)] == [False, True, True, False]
    assert KeyForm(1.0, 2.0, False, 10, 20).holds_for(5)  # a key that does not follow the batch always holds


def test_the_outlook_range_brackets_the_later_strategies():
    # Segment 1 calls at 53 tokens for 4 ms (no compaction): Preserve 0.212, Swap 0.2809, Discard
    # t(53)·(53 + B) = 0.01265·(53 + B) < 0.212 only for B < -36: never, so Preserve from 0 on.
    # Segment 2 calls at 53 + 5 + 1 + 3 = 62 tokens for 1 ms: Preserve 0.062 is cheapest at any batch.
    from marsched.workload import ApiCall, ApiType, build_request
    request = build_request("R", 100, [(4, ApiCall(ApiType.OTHER, 1.0, 10, 40)), (3, ApiCall(ApiType.OTHER, 0.004, 5)),
                                       (3, ApiCall(ApiType.OTHER, 0.001, 2)), (2, None)])
    policy = make_policy("mars", COST)
    progress = _progress(request, policy)
    form = policy.queue_key_form(progress, EngineLoad(0.0, 0, 0.01, 10_000))
    assert form.follows_running_kv and (form.running_kv_from, form.running_kv_below) == (0, float("inf"))
    # A call where Discard wins at a small batch: 104 tokens kept from 2,000 for 0.5 s.
    request = build_request("R", 100, [(4, ApiCall(ApiType.OTHER, 1.0, 10)), (40, ApiCall(ApiType.OTHER, 0.05, 5)),
                                       (2, None)])
    progress = _progress(request, policy)
    # Segment 1 calls at 115 + 40 = 155 for 50 ms: Preserve 7.75, Swap 2·155²/20000 = 2.4025, Discard
    # t(155)·(155 + B) = 0.01775·(155 + B) < 2.4025 while B < -19.6: never.
    assert discard_cheapest_below(155, 0.05, COST) == 0
    small = policy.queue_key_form(progress, EngineLoad(0.0, 0, 0.01, 10_000))
    assert (small.running_kv_from, small.running_kv_below) == (0, float("inf"))


def _claude_code_run(monkeypatch, slow: bool, policy_name: str):
    if slow:  # every key that follows the batch is recomputed at every refresh, as before the ranges
        monkeypatch.setattr(KeyForm, "holds_for", lambda self, running_kv_tokens: not self.follows_running_kv)
    templates = [scale_tokens(r, 0.01) for r in load_named("claude-code")]
    requests = poisson_arrivals(templates, 2.0, 60.0, seed=3)
    profile = dataclasses.replace(load_profile("llama3-8b-h100"), device_blocks=600)
    calls = {"forms": 0, "bounded": 0}
    policy = make_policy(policy_name, profile.cost)
    original = type(policy).queue_key_form

    def counting(self, progress, load):
        calls["forms"] += 1
        form = original(self, progress, load)
        calls["bounded"] += form.running_kv_from > 0 or form.running_kv_below < float("inf")
        return form

    monkeypatch.setattr(type(policy), "queue_key_form", counting)
    trace = Recorder()
    result = make_simulator(requests, profile, policy, trace=trace).run()
    monkeypatch.undo()
    return result.records, trace.events, calls


@pytest.mark.parametrize("policy_name", ["mars"])
def test_a_run_with_ranges_is_the_run_that_recomputes_every_key(monkeypatch, policy_name):
    fast_records, fast_events, fast_forms = _claude_code_run(monkeypatch, False, policy_name)
    slow_records, slow_events, slow_forms = _claude_code_run(monkeypatch, True, policy_name)
    assert fast_forms["forms"] < slow_forms["forms"]  # the fast path was taken
    assert fast_forms["bounded"]  # and some keys held only over part of the batch's range
    strip = [f.name for f in dataclasses.fields(RequestRecord)]
    assert [[getattr(r, f) for f in strip] for r in fast_records] == [[getattr(r, f) for f in strip] for r in slow_records]
    assert fast_events == slow_events


def test_a_later_discard_bounds_the_key_from_above_and_a_later_swap_from_below():
    # Segment 1 starts at 54 + 40 = 94 and calls at 104 for 30 ms keeping 20: Discard while the
    # batch holds fewer than 31 tokens (test_the_bound_by_hand), Swap from 31 on.
    from marsched.workload import ApiCall, ApiType, build_request
    request = build_request("R", 50, [(4, ApiCall(ApiType.OTHER, 1.0, 40)), (10, ApiCall(ApiType.OTHER, 0.03, 5, 20)),
                                      (2, None)])
    policy = make_policy("mars", COST)
    progress = _progress(request, policy)
    for batch, strategy, kv_range in ((0, Strategy.DISCARD, (0, 31)), (30, Strategy.DISCARD, (0, 31)),
                                      (31, Strategy.SWAP, (31, float("inf"))), (500, Strategy.SWAP, (31, float("inf")))):
        load = EngineLoad(0.0, batch, 0.01, 10_000)
        assert policy.outlook(progress, load)[1].strategy is strategy
        form = policy.queue_key_form(progress, load)
        assert (form.running_kv_from, form.running_kv_below) == kv_range

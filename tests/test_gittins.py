"""The Gittins rank over a program's turns left, and what the requests that ended teach it."""

import pytest

from marsched.policy.gittins import MAX_HORIZONS, gittins_outlook, horizons
from marsched.policy.program import PRIOR_TURNS_LEFT, PRIOR_WEIGHT, ProgramLengths, ProgramOutlook, rest_area_per_iteration
from marsched.policy.program_rest import ProgramRest, call_chance
from marsched.workload import ApiCall, ApiType, build_request
from marsched.workload.past import RequestPast

TAU = 0.02


def _rank(outlook: ProgramOutlook, current_s: float, context: int) -> float:
    return (current_s + TAU * rest_area_per_iteration(outlook, context)) / outlook.completion


def test_a_known_size_is_its_remaining_work():
    outlook = gittins_outlook([(3, 1.0)], 5.0, 1000, 50.0, 80.0, TAU)
    assert (outlook.turns_left, outlook.turns_left_sq, outlook.completion) == (3, 9, 1.0)
    assert _rank(outlook, 5.0, 1000) == pytest.approx(5.0 + TAU * rest_area_per_iteration(ProgramOutlook(3, 50, 80), 1000))


def test_a_likely_end_is_ranked_by_the_chance_of_it():
    # Nine in ten programs end after this turn, one goes on for 20: the rank stops at the first horizon.
    counts = [(0, 9.0), (20, 1.0)]
    outlook = gittins_outlook(counts, 5.0, 1000, 50.0, 80.0, TAU)
    assert outlook.completion == pytest.approx(0.9) and outlook.turns_left == 0  # E[min(N, 0)]
    whole = ProgramOutlook(2.0, 50.0, 80.0, 40.0, 1.0)  # every horizon: E[N] = 2, E[N²] = 40
    assert _rank(outlook, 5.0, 1000) == pytest.approx(5.0 / 0.9)
    assert _rank(outlook, 5.0, 1000) < _rank(whole, 5.0, 1000)
    # The least of every horizon's rank.
    assert _rank(outlook, 5.0, 1000) == pytest.approx(min(5.0 / 0.9, _rank(whole, 5.0, 1000)))


def test_a_program_that_goes_on_for_sure_is_priced_whole():
    outlook = gittins_outlook([(2, 1.0), (4, 1.0)], 0.0, 500, 10.0, 10.0, TAU)
    # Stopping at 2 turns finishes half the programs for two turns' work each; all the way, all of them.
    at_two = ProgramOutlook(2.0, 10.0, 10.0, 4.0, 0.5)
    at_four = ProgramOutlook(3.0, 10.0, 10.0, 10.0, 1.0)
    expected = min((at_two, at_four), key=lambda o: _rank(o, 0.0, 500))
    assert outlook == expected


def test_horizons_are_thinned_by_weight_and_keep_the_last():
    few = [(n, 1.0) for n in range(10)]
    assert horizons(few) == list(range(10))
    many = [(n, 1.0) for n in range(500)]
    chosen = horizons(many)
    assert len(chosen) <= MAX_HORIZONS + 1 and chosen[-1] == 499 and chosen == sorted(set(chosen))
    with pytest.raises(ValueError, match="at least one"):
        gittins_outlook([(1, 0.0)], 1.0, 10, 1.0, 1.0, TAU)


def test_turns_left_counts_hold_the_prior_and_the_programs_that_got_this_far():
    lengths = ProgramLengths()
    for turns in (1, 2, 2, 5):
        lengths.ended(turns)
    counts = dict(lengths.turns_left_counts(2))
    assert counts == {0: 2.0, round(PRIOR_TURNS_LEFT): PRIOR_WEIGHT, 3: 1.0}
    lengths.ended(9)  # a new end is seen at once (the cached distribution is dropped)
    assert dict(lengths.turns_left_counts(2))[7] == 1.0
    bounded = ProgramLengths(limit=2)
    for turns in (4, 6, 8):
        bounded.ended(turns)
    assert dict(bounded.turns_left_counts(1)) == {round(PRIOR_TURNS_LEFT): PRIOR_WEIGHT, 5: 1.0, 7: 1.0}


def test_program_rest_learns_turns_replies_and_growth_per_class():
    rest = ProgramRest()
    call = ApiCall(ApiType.MATH, 0.1, 10)
    for _ in range(3):
        rest.ended("math", build_request("m", 100, [(20, call), (40, call), (60, None)]).segments)
    past = RequestPast.of(build_request("n", 100, [(20, call), (30, None)]), 1)
    outlook, counts = rest.outlook(past, predicted_tokens=7)
    # Two turns so far; every math program had three: one left (and the prior's weight).
    assert outlook.turns_left == pytest.approx((3 * 1 + PRIOR_TURNS_LEFT * PRIOR_WEIGHT) / (3 + PRIOR_WEIGHT))
    assert outlook.output_tokens == pytest.approx(50.0)  # no later reply of its own yet: its class's (40, 60)
    assert outlook.growth_tokens == pytest.approx((30 + 40) / 2)  # its own growth (20 + 10) and its class's (40)
    assert call_chance(counts) == pytest.approx(1.0)
    unseen = RequestPast.of(build_request("q", 100, [(20, None)]), 0)
    assert rest.outlook(unseen, 7)[0].turns_left == pytest.approx(
        (3 * 2 + PRIOR_TURNS_LEFT * PRIOR_WEIGHT) / (3 + PRIOR_WEIGHT))  # a new class: every class's programs
    assert call_chance([(0, 3.0), (1, 1.0)]) == pytest.approx(0.25)


def test_an_outlook_completion_chance_is_checked():
    with pytest.raises(ValueError, match="completion"):
        ProgramOutlook(1.0, 1.0, 1.0, None, 0.0)


def test_turns_left_from_distinct_counts_is_the_conditional_mean_over_every_program():
    from marsched.policy.program import expected_turns_left

    lengths = ProgramLengths(limit=7)
    ended = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]
    for turns in ended:
        lengths.ended(turns)
    kept = sorted(ended[-7:])  # the latest `limit`
    for so_far in range(0, 11):
        assert lengths.turns_left(so_far) == pytest.approx(expected_turns_left(kept, so_far))


def test_a_horizon_short_of_the_longest_programs_prices_their_second_moment():
    # Most programs end within 1 turn, a few go on to 30: the rank stops at 1, where the long
    # ones still count one turn each (E[min(N, 1)²] takes them in).
    counts = [(0, 5.0), (1, 5.0), (30, 1.0)]
    outlook = gittins_outlook(counts, 5000.0, 1000, 20.0, 100.0, TAU)
    assert outlook.completion == pytest.approx(10 / 11)
    assert outlook.turns_left == pytest.approx((5 * 1 + 1 * 1) / 11)
    assert outlook.turns_left_sq == pytest.approx((5 * 1 + 1 * 1) / 11)


def test_thinned_horizons_are_spread_by_weight_and_the_best_may_lie_past_a_skipped_one():
    many = [(n, 1.0) for n in range(96)]  # twice MAX_HORIZONS: every other count, and the last
    assert horizons(many) == list(range(1, 96, 2))
    heavy_first = [(0, 48.0)] + [(n, 1.0) for n in range(1, 60)]
    chosen = horizons(heavy_first)
    assert chosen[0] == 0 and chosen[-1] == 59 and len(chosen) <= MAX_HORIZONS + 1
    # The rank is taken over the chosen horizons only, skipped ones in between.
    counts = [(n, 1.0) for n in range(100)]
    best = gittins_outlook(counts, 0.0, 100, 1.0, 1.0, TAU)
    ranks = []
    for index in horizons(counts):
        turns = counts[index][0]
        below = counts[:index + 1]
        beyond = len(counts) - len(below)
        candidate = ProgramOutlook((sum(t for t, _ in below) + beyond * turns) / 100, 1.0, 1.0,
                                   (sum(t * t for t, _ in below) + beyond * turns * turns) / 100, len(below) / 100)
        ranks.append((_rank(candidate, 0.0, 100), candidate))
    assert best == min(ranks, key=lambda r: r[0])[1]


def test_each_class_learns_from_its_own_requests_and_a_new_class_from_all():
    rest = ProgramRest()
    math, qa = ApiCall(ApiType.MATH, 0.1, 10), ApiCall(ApiType.QA, 1.0, 300)
    for _ in range(4):
        rest.ended("math", build_request("m", 100, [(20, math), (40, math), (40, None)]).segments)
        rest.ended("qa", build_request("q", 100, [(20, qa), (400, qa), (400, qa), (400, None)]).segments)
    first = lambda cls: RequestPast(f"{cls}-1", cls, 100, 100, ())  # noqa: E731
    math_outlook, _ = rest.outlook(first("math"), predicted_tokens=7)
    qa_outlook, _ = rest.outlook(first("qa"), predicted_tokens=7)
    new_outlook, _ = rest.outlook(first("tts"), predicted_tokens=7)
    assert math_outlook.output_tokens == pytest.approx((0 + 40) / 1)  # no own replies: its class's mean
    assert qa_outlook.output_tokens == pytest.approx(400)
    # Growth per segment: its reply and the call's return (math 30 and 50; qa 320, 700, 700).
    assert math_outlook.growth_tokens == pytest.approx(40) and qa_outlook.growth_tokens == pytest.approx(1720 / 3)
    assert math_outlook.turns_left < qa_outlook.turns_left
    assert new_outlook.output_tokens == pytest.approx((4 * 2 * 40 + 4 * 3 * 400) / (4 * 2 + 4 * 3))  # every class
    assert new_outlook.growth_tokens == pytest.approx((4 * 80 + 4 * 1720) / (4 * 2 + 4 * 3))  # every class's
    assert rest.lengths("tts") is rest.lengths("")
    assert len(ProgramRest().lengths("x")) == 0  # nothing ended yet: an empty history, not an error
    # A request's own later replies count, its first segment's does not.
    own = build_request("o", 100, [(900, math), (10, math), (30, math), (5, None)])
    outlook, _ = rest.outlook(RequestPast.of(own, 3), predicted_tokens=7)
    assert outlook.output_tokens == pytest.approx((10 + 30 + 256) / 3)  # its class "" is every class: 256
    assert call_chance([]) == 1.0

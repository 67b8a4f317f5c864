"""A conversation turn's rest of its program in the MARS key (`marsched.policy.program`)."""

from __future__ import annotations

import pytest

from marsched.audit.keys import recompute_key
from marsched.policy.cost_model import CostModel
from marsched.policy.load import EngineLoad
from marsched.policy.program import ProgramLengths, ProgramOutlook, expected_turns_left, rest_area_per_iteration
from marsched.policy.progress import KeyBasis, RequestProgress
from marsched.policy.progress import KeyBasis
from marsched.policy.registry import make_policy
from marsched.policy.trace_fields import key_basis
from marsched.predict.segment import SegmentPrediction
from marsched.workload.model import build_request


def test_the_rest_is_the_sum_of_the_turns_to_come_counted_one_by_one():
    outlook = ProgramOutlook(turns_left=3, output_tokens=10, growth_tokens=50)
    context = 200
    by_turn = sum(10 * (context + k * 50 + 10 / 2) for k in (1, 2, 3))
    assert rest_area_per_iteration(outlook, context) == pytest.approx(by_turn)
    assert rest_area_per_iteration(ProgramOutlook(0, 10, 50), context) == 0.0
    assert rest_area_per_iteration(ProgramOutlook(2.5, 10, 0), context) == pytest.approx(2.5 * 10 * 205)


def test_turns_left_is_the_mean_over_programs_that_got_as_far_with_the_prior_for_few():
    ended = sorted([1, 2, 2, 5, 9])
    # at turn 2: programs of 2, 2, 5, 9 turns got there; they had 0, 0, 3, 7 left
    assert expected_turns_left(ended, 2, prior=1.0, prior_weight=0.0) == pytest.approx(10 / 4)
    assert expected_turns_left(ended, 2, prior=1.0, prior_weight=4.0) == pytest.approx((10 + 4) / 8)
    assert expected_turns_left([], 3, prior=1.5, prior_weight=4.0) == 1.5
    assert expected_turns_left(ended, 10, prior=1.0, prior_weight=4.0) == 1.0  # none got this far


def test_program_lengths_forget_the_oldest_past_their_limit():
    lengths = ProgramLengths(limit=3)
    for turns in (9, 1, 1, 1):
        lengths.ended(turns)
    assert len(lengths) == 3
    assert lengths.turns_left(2) == pytest.approx(1.0)  # the 9 is gone: only the prior speaks


def progress_with(program):
    request = build_request("r", 300, [(20, None)])
    progress = RequestProgress(request, order_s=0.0, predictions=[SegmentPrediction(20, 0.0, 0, False)],
                               program=program)
    progress.key_basis = KeyBasis(EngineLoad(0.0, 0, 0.05, 0), 0, progress.context_tokens, 0, 0, None)
    return progress


def test_mars_ranks_a_turn_with_more_of_its_program_to_come_later_and_the_audit_recomputes_it():
    policy = make_policy("mars", CostModel(1e-4, 0.02, 2048, 1e5))
    load = EngineLoad(0.0, 0, 0.05, 0)
    alone, near_end, far_from_end = (progress_with(None), progress_with(ProgramOutlook(0.5, 20, 60)),
                                     progress_with(ProgramOutlook(6, 20, 60)))
    keys = [policy.queue_key(p, load) for p in (alone, near_end, far_from_end)]
    assert keys[0] < keys[1] < keys[2]
    assert keys[2] - keys[0] == pytest.approx(rest_area_per_iteration(far_from_end.program, 300) * 0.05)
    for progress, key in zip((alone, far_from_end), (keys[0], keys[2])):
        assert recompute_key(policy, key_basis(progress)) == pytest.approx(key)
    assert "program" not in key_basis(alone) and key_basis(far_from_end)["program"] == [6, 20, 60]

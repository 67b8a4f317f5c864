"""A conversation's turns as one program to the vLLM scheduler (`marsched.vllm.programs`)."""

from __future__ import annotations

import pytest

from marsched.policy.progress import RequestProgress
from marsched.vllm.programs import ProgramLedger
from marsched.workload.model import build_request


def turn(prompt_tokens: int) -> RequestProgress:
    return RequestProgress(build_request("r", prompt_tokens, [(10, None)]), order_s=0.0)


def test_a_follow_up_takes_over_its_programs_wait_and_service_and_a_promoted_turn_resets_the_wait():
    ledger = ProgramLedger()
    first = turn(100)
    ledger.turn_arrives("c", first, predicted_tokens=10)
    first.waited_iterations, first.waited_s, first.attained_iterations, first.generated = 30, 1.5, 12, 8
    ledger.turn_ends("c", first, last=False)
    second = turn(150)
    ledger.turn_arrives("c", second, predicted_tokens=10)
    assert (second.waited_iterations, second.waited_s, second.attained_iterations) == (30, 1.5, 12)
    assert second.attained_before_segment == 12
    second.waited_iterations, second.promoted = 90, True
    ledger.turn_ends("c", second, last=False)
    third = turn(200)
    ledger.turn_arrives("c", third, predicted_tokens=10)
    assert third.waited_iterations == 0  # its program was served as starving
    other = turn(100)
    ledger.turn_arrives("d", other, predicted_tokens=10)
    assert other.waited_iterations == 0 and other.attained_iterations == 0


def test_a_promotion_for_life_lasts_the_programs_life():
    ledger = ProgramLedger()
    first = turn(100)
    ledger.turn_arrives("c", first, predicted_tokens=10)
    assert not first.elder
    first.promoted = first.elder = True  # starvation `for_life`: as a simulated request over its calls
    ledger.turn_ends("c", first, last=False)
    second = turn(150)
    ledger.turn_arrives("c", second, predicted_tokens=10)
    assert second.elder and not second.promoted and second.waited_iterations == 0
    ledger.turn_ends("c", second, last=True)
    again = turn(100)  # the program ended: a new one under the same name starts afresh
    ledger.turn_arrives("c", again, predicted_tokens=10)
    other = turn(100)
    ledger.turn_arrives("d", other, predicted_tokens=10)
    assert not again.elder and not other.elder


def test_the_outlook_reads_the_programs_replies_growth_and_the_ended_programs_lengths():
    ledger = ProgramLedger()
    for conversation, turns in (("a", 2), ("b", 4)):  # two programs end, after 2 and 4 turns
        for _ in range(turns):
            progress = turn(100)
            ledger.turn_arrives(conversation, progress, predicted_tokens=5)
            ledger.turn_ends(conversation, progress, last=False)
        ledger.ended(conversation)
    assert ledger.snapshot() == {"programs_followed": 0, "programs_ended": 2}
    first = turn(1000)
    ledger.turn_arrives("c", first, predicted_tokens=40)
    assert first.program.output_tokens == 40 and first.program.growth_tokens == 40  # nothing seen yet
    assert first.program.turns_left == pytest.approx(((2 - 1) + (4 - 1) + 1.0 * 4) / (2 + 4))
    first.generated = 20
    ledger.turn_ends("c", first, last=False)
    second = turn(1300)
    ledger.turn_arrives("c", second, predicted_tokens=40)
    assert (second.program.output_tokens, second.program.growth_tokens) == (20, 300)
    ledger.turn_ends("c", second, last=True)  # a last turn ends the program
    assert ledger.snapshot() == {"programs_followed": 0, "programs_ended": 3}
    ledger.turn_ends("unknown", turn(10), last=True)  # a program it does not follow: nothing happens
    assert ledger.snapshot()["programs_ended"] == 3


def test_the_ledger_forgets_the_least_recently_seen_program_past_its_limit():
    ledger = ProgramLedger(limit=2)
    for conversation in ("a", "b", "a", "c"):
        ledger.turn_arrives(conversation, turn(10), predicted_tokens=1)
    assert ledger.snapshot()["programs_followed"] == 2
    again = turn(10)
    ledger.turn_arrives("b", again, predicted_tokens=1)  # "b" was forgotten: a new program
    assert ledger.snapshot()["programs_followed"] == 2


def test_a_gittins_ledger_gives_each_turn_its_programs_turns_left_to_rank_over():
    from marsched.policy.load import EngineLoad
    from marsched.policy.program_rest import RestRule
    from marsched.policy.registry import make_policy
    from simhelpers import COST

    keys = {}
    for rest in (RestRule.GITTINS, RestRule.MEAN):
        ledger = ProgramLedger(rest=rest)
        for conversation, turns in (("a", 1), ("b", 1), ("c", 1), ("d", 12)):
            for _ in range(turns):
                progress = turn(100)
                ledger.turn_arrives(conversation, progress, predicted_tokens=10)
                ledger.turn_ends(conversation, progress, last=False)
            ledger.ended(conversation)
        progress = turn(300)
        ledger.turn_arrives("new", progress, predicted_tokens=10)
        expected = ledger.lengths.turns_left_counts(1) if rest is RestRule.GITTINS else None
        assert progress.rest_counts == expected
        policy = make_policy("mars", COST)
        policy.start_segment(progress, EngineLoad(0.0, 0, 0.02, 1_000))
        keys[rest] = policy.queue_key(progress, EngineLoad(0.0, 0, 0.02, 1_000))
    assert keys[RestRule.GITTINS] != keys[RestRule.MEAN]


def test_a_programs_arrival_is_its_first_turns_until_it_ends():
    ledger = ProgramLedger()
    first = RequestProgress(build_request("r", 100, [(10, None)]), order_s=2.5)
    ledger.turn_arrives("c", first, predicted_tokens=10)
    ledger.turn_ends("c", first, last=False)
    later = RequestProgress(build_request("r", 150, [(10, None)]), order_s=9.0)
    ledger.turn_arrives("c", later, predicted_tokens=10)
    assert ledger.arrival("c") == 2.5 and ledger.arrival("unknown") is None
    ledger.turn_ends("c", later, last=True)
    assert ledger.arrival("c") is None

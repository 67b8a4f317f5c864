"""Nudge-M (`mars-nudge`): the decision, the learnt size bands, the queue's places, a simulated run.

Sizes here are single-segment requests of one prompt and different reply lengths: MARS's key
(memory × time) grows with the reply, so the reply length orders the sizes.
"""

import json

import pytest
from typer.testing import CliRunner

from marsched.cli import app
from marsched.policy.load import EngineLoad
from marsched.policy.nudge import (
    DEFAULT_NUDGE_M, NudgeCandidate, SizeBands, SizeHistory, nudge_partner, terciles,
)
from marsched.policy.policy import Order
from marsched.policy.progress import RequestProgress
from marsched.policy.queue import WaitingQueue
from marsched.policy.registry import make_policy
from marsched.vllm.programs import ProgramLedger
from marsched.workload import ApiCall, ApiType, build_request
from simhelpers import COST

BANDS = SizeBands(small_below_s=1.0, large_above_s=10.0)
SMALL, MEDIUM, LARGE = NudgeCandidate(0.5, False), NudgeCandidate(5.0, False), NudgeCandidate(20.0, False)
CAPACITY = 10_000
LOAD = EngineLoad(0.0, 0, 0.02, 1_000, kv_capacity_tokens=CAPACITY)
REPLY = {"small": 5, "medium": 150, "large": 1_000}  # tokens: under, between and over the primed terciles


# --- the decision -----------------------------------------------------------------------


def test_a_small_arrival_swaps_with_a_large_request_among_the_last_m():
    assert nudge_partner(0.5, [LARGE], BANDS, window=1) == 0
    assert nudge_partner(0.5, [MEDIUM, MEDIUM, LARGE], BANDS, window=3) == 2


def test_not_beyond_the_window():
    assert nudge_partner(0.5, [MEDIUM, LARGE], BANDS, window=1) is None
    assert nudge_partner(0.5, [MEDIUM, MEDIUM, MEDIUM, LARGE], BANDS, window=3) is None


def test_a_large_request_is_swapped_back_at_most_once():
    nudged = NudgeCandidate(20.0, True)
    assert nudge_partner(0.5, [nudged], BANDS, window=3) is None
    assert nudge_partner(0.5, [nudged, LARGE], BANDS, window=3) == 1


def test_the_large_request_nearest_the_back_is_the_one():
    assert nudge_partner(0.5, [MEDIUM, LARGE, LARGE], BANDS, window=3) == 1


def test_only_a_small_arrival_swaps_and_only_with_a_large_request():
    for arrival in (5.0, 20.0):  # medium, large
        assert nudge_partner(arrival, [LARGE, LARGE], BANDS, window=3) is None
    assert nudge_partner(0.5, [SMALL, MEDIUM], BANDS, window=3) is None


def test_sizes_on_a_band_edge_are_medium():
    assert nudge_partner(1.0, [LARGE], BANDS, window=1) is None  # at the small edge: not small
    assert nudge_partner(0.5, [NudgeCandidate(10.0, False)], BANDS, window=1) is None  # at the large edge: not large
    assert nudge_partner(0.999, [NudgeCandidate(10.001, False)], BANDS, window=1) == 0


def test_no_bands_yet_is_first_come_first_served_and_the_window_is_checked():
    assert nudge_partner(0.5, [LARGE], None, window=3) is None
    assert nudge_partner(0.5, [], BANDS, window=3) is None
    with pytest.raises(ValueError, match="window M must be >= 1"):
        nudge_partner(0.5, [LARGE], BANDS, window=0)


def test_the_bands_are_the_terciles_of_the_sizes_seen_and_follow_the_recent_ones():
    assert terciles([float(s) for s in range(9)]) == SizeBands(3.0, 6.0)
    history = SizeHistory(kept=6, needed=3)
    history.observe(1.0)
    history.observe(2.0)
    assert history.bands() is None  # too few sizes: nothing is small or large
    history.observe(3.0)
    assert history.bands() == SizeBands(2.0, 3.0)
    for size in (10.0, 20.0, 30.0, 40.0, 50.0, 60.0):  # the oldest ones drop out
        history.observe(size)
    assert len(history) == 6 and history.bands() == SizeBands(30.0, 50.0)
    one = SizeHistory(kept=1, needed=1)
    one.observe(5.0)
    one.observe(7.0)
    assert one.bands() == SizeBands(7.0, 7.0)
    assert SizeHistory(kept=3, needed=3).bands() is None
    for kept, needed in ((2, 3), (3, 0)):
        with pytest.raises(ValueError, match="size history"):
            SizeHistory(kept=kept, needed=needed)


# --- the policy --------------------------------------------------------------------------


def test_mars_nudge_ranks_by_place_with_its_window_and_no_promotions():
    policy = make_policy("mars-nudge", COST)
    assert policy.order is Order.NUDGE and policy.nudge_m == DEFAULT_NUDGE_M
    assert not policy.starvation.enabled and not policy.keys_follow_load and policy.ranks_by_program_arrival
    assert make_policy("mars-boost", COST).nudge_m is None
    progress = RequestProgress(build_request("a", 100, [(10, None)], 2.5), order_s=2.5)
    policy.start_segment(progress, LOAD)
    assert policy.queue_key(progress, LOAD) == 2.5
    mars = make_policy("mars", COST)
    twin = RequestProgress(build_request("a", 100, [(10, None)], 2.5), order_s=2.5)
    mars.start_segment(twin, LOAD)
    assert policy.device_size_s(progress, LOAD) == pytest.approx(mars.queue_key(twin, LOAD) / CAPACITY)
    with pytest.raises(ValueError, match="KV capacity"):
        policy.device_size_s(progress, EngineLoad(0.0, 0, 0.02, 1_000))
    for m in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="nudge window M"):
            make_policy("mars-nudge", COST, nudge_m=m)


# --- the queue ---------------------------------------------------------------------------


class Line:
    """A mars-nudge waiting queue that has seen 30 arrivals of replies 10 to 300 tokens (its bands)."""

    def __init__(self, m: int = 3, primed: int = 30) -> None:
        self.policy = make_policy("mars-nudge", COST, nudge_m=m)
        self.queue = WaitingQueue(self.policy)
        self.clock = 0.0
        self.progress: dict[str, RequestProgress] = {}
        for i in range(primed):
            self.arrive(f"seen-{i}", reply=10 * (i + 1))
        while self.queue.pop(0, self.clock) is not None:
            pass

    def arrive(self, rid: str, kind: str = "medium", reply: int | None = None, at_s: float | None = None,
               calls: bool = False) -> RequestProgress:
        self.clock = self.clock + 1.0 if at_s is None else at_s
        tokens = REPLY[kind] if reply is None else reply
        plan = [(tokens, ApiCall(ApiType.TOOL, 1.0, 10)), (5, None)] if calls else [(tokens, None)]
        progress = RequestProgress(build_request(rid, 100, plan, self.clock), order_s=self.clock)
        self.progress[rid] = progress
        self.policy.start_segment(progress, LOAD)
        self.queue.push(progress, LOAD, 0)
        return progress

    def order(self) -> list[str]:
        return [p.request_id for p in self.queue.ordered()]

    def pop(self) -> RequestProgress:
        return self.queue.pop(0, self.clock)


def test_the_primed_bands_sit_between_the_kinds():
    line = Line()
    bands = line.queue._sizes.bands()
    sizes = {kind: line.policy.device_size_s(line.arrive(kind, kind), LOAD) for kind in REPLY}
    assert bands.is_small(sizes["small"]) and bands.is_large(sizes["large"])
    assert not bands.is_small(sizes["medium"]) and not bands.is_large(sizes["medium"])


def test_a_small_arrival_takes_the_place_of_a_large_one_among_the_last_m():
    line = Line(m=3)
    line.arrive("a")
    big = line.arrive("big", "large")
    line.arrive("c")
    small = line.arrive("s", "small")
    assert line.order() == ["a", "s", "c", "big"]
    assert (small.order_s, big.order_s) == (2.0 + 30, 4.0 + 30)  # the places, exchanged
    assert big.nudged and not small.nudged
    assert [line.pop().request_id for _ in range(4)] == ["a", "s", "c", "big"]
    assert line.pop() is None


def test_a_large_request_beyond_the_window_keeps_its_place():
    line = Line(m=1)
    line.arrive("big", "large")
    line.arrive("c")
    line.arrive("s", "small")
    assert line.order() == ["big", "c", "s"]
    wide = Line(m=2)
    wide.arrive("big", "large")
    wide.arrive("c")
    wide.arrive("s", "small")
    assert wide.order() == ["s", "c", "big"]


def test_a_large_request_is_swapped_back_once_and_the_nearest_one_goes():
    line = Line(m=3)
    line.arrive("big-1", "large")
    line.arrive("big-2", "large")
    line.arrive("s-1", "small")
    assert line.order() == ["big-1", "s-1", "big-2"]
    line.arrive("s-2", "small")  # big-2 is at the back again, but was swapped: big-1 goes
    assert line.order() == ["s-2", "s-1", "big-2", "big-1"]
    line.arrive("s-3", "small")  # both swapped once: no more
    assert line.order() == ["s-2", "s-1", "big-2", "big-1", "s-3"]


def test_medium_and_large_arrivals_never_swap():
    line = Line(m=3)
    line.arrive("big", "large")
    line.arrive("m")
    line.arrive("big-2", "large")
    assert line.order() == ["big", "m", "big-2"] and not line.progress["big"].nudged


def test_at_an_equal_place_the_small_arrival_goes_first():
    line = Line(m=1)
    line.arrive("big", "large", at_s=100.0)
    small = line.arrive("s", "small", at_s=100.0)
    assert line.order() == ["s", "big"] and small.order_s == 100.0


def test_no_swap_before_the_policy_has_seen_enough_sizes():
    line = Line(m=3, primed=0)
    line.arrive("big", reply=10_000)
    line.arrive("s", reply=1)
    assert line.order() == ["big", "s"]


def test_the_bands_are_learnt_from_earlier_arrivals_only():
    line = Line(m=3, primed=28)
    line.arrive("big", "large")  # the 29th size, seen after its own decision
    line.arrive("s", "small")  # decided on 29 sizes: too few, no bands yet
    assert line.order() == ["big", "s"]
    line.arrive("s-2", "small")  # 30 sizes before it: it swaps
    assert line.order() == ["s-2", "s", "big"]


def test_only_an_arrival_at_the_back_swaps():
    line = Line(m=3)
    line.arrive("big", "large", at_s=40.0)
    line.arrive("big-2", "large", at_s=50.0)
    small = line.arrive("s", "small", at_s=45.0)  # a place before the back's: it stays there
    assert line.order() == ["big", "s", "big-2"] and small.order_s == 45.0
    assert not line.progress["big"].nudged and not line.progress["big-2"].nudged


def test_a_request_back_from_a_call_does_not_swap_even_at_the_back():
    line = Line(m=3)
    big = line.arrive("big", "large")
    returning = line.arrive("r", "medium", calls=True)  # not small at its arrival: no swap
    assert line.order() == ["big", "r"]
    assert line.pop() is big and line.pop() is returning
    for progress in (big, returning):  # both ran: big is preempted, r reaches its call
        progress.ran_before = True
        progress.attained_iterations = 3
    line.queue.push(big, LOAD, 0)
    returning.segment_index, returning.context_tokens, returning.computed_tokens = 1, 260, 0
    line.policy.start_segment(returning, LOAD)
    assert line.queue._sizes.bands().is_small(line.policy.device_size_s(returning, LOAD))  # small now, at the back
    line.queue.push(returning, LOAD, 0)
    assert line.order() == ["big", "r"] and not big.nudged


def test_a_request_pushed_again_without_running_decides_no_more():
    line = Line(m=3)
    line.arrive("big", "large")
    again = line.arrive("r", "medium")
    line.queue.remove("r", 0, line.clock)  # vLLM removes it and adds it back (a skipped step)
    again.predictions[0].output_tokens = REPLY["small"]  # told a shorter reply meanwhile
    line.queue.push(again, LOAD, 0)
    assert line.order() == ["big", "r"] and not line.progress["big"].nudged


def test_a_returning_request_keeps_the_place_a_swap_gave_it_and_does_not_swap_again():
    line = Line(m=3)
    big = line.arrive("big", "large", calls=True)
    small = line.arrive("s", "small", calls=True)
    places = (small.order_s, big.order_s)
    assert line.order() == ["s", "big"]
    for progress in (line.pop(), line.pop()):  # both run to their call
        progress.ran_before = True
        progress.attained_iterations = 3
        progress.segment_index = 1
    line.arrive("late", "large")
    line.queue.push(small, LOAD, 0)  # back from its call: at the back, small, behind a large one
    line.queue.push(big, LOAD, 0)
    assert (small.order_s, big.order_s) == places
    assert line.order() == ["s", "big", "late"]


def test_a_request_pushed_again_before_it_ran_does_not_swap_again():
    line = Line(m=3)
    line.arrive("big", "large")
    small = line.arrive("s", "small")
    assert line.pop() is small
    line.queue.push(small, LOAD, 0)  # vLLM's skipped-request path: an ordinary push
    line.arrive("big-2", "large")
    assert line.order() == ["s", "big", "big-2"] and not line.progress["big-2"].nudged


def test_a_held_request_put_back_keeps_its_place_in_the_window():
    line = Line(m=1)
    line.arrive("big", "large")
    held = line.pop()
    line.queue.push_back(held)  # a peek that did not admit it
    line.arrive("s", "small")
    assert line.order() == ["s", "big"]


# --- over HTTP: a program's turns keep its place -----------------------------------------


class Http:
    """A mars-nudge queue fed turns through the vLLM plugin's program ledger."""

    def __init__(self) -> None:
        self.line = Line(m=3)
        self.ledger = ProgramLedger(program_arrival=self.line.policy.ranks_by_program_arrival)

    def turn(self, rid: str, conversation: str, kind: str, at_s: float) -> RequestProgress:
        progress = RequestProgress(build_request(rid, 100, [(REPLY[kind], None)], at_s), order_s=at_s)
        self.ledger.turn_arrives(conversation, progress, predicted_tokens=REPLY[kind])
        self.line.policy.start_segment(progress, LOAD)
        self.line.queue.push(progress, LOAD, 0)
        return progress

    def ran(self, progress: RequestProgress, conversation: str) -> None:
        if progress.request_id in self.line.queue:
            self.line.queue.remove(progress.request_id, 0, self.line.clock)
        progress.attained_iterations = 4
        self.ledger.turn_ends(conversation, progress, last=False)


def test_a_later_turn_keeps_the_place_a_swap_gave_its_program_and_its_mark():
    http = Http()
    line, turn = http.line, http.turn
    big = turn("big-1", "big", "large", 100.0)
    small = turn("s-1", "s", "small", 101.0)
    assert (small.order_s, big.order_s) == (100.0, 101.0) and line.order() == ["s-1", "big-1"]
    http.ran(small, "s")
    http.ran(big, "big")
    later = turn("big-2", "big", "large", 200.0)
    assert later.order_s == 101.0 and later.nudged
    assert turn("s-2", "s", "small", 201.0).order_s == 100.0


def test_a_later_turn_does_not_swap_even_at_the_back():
    http = Http()
    big = http.turn("big-1", "big", "large", 90.0)
    http.ran(http.turn("p-1", "p", "medium", 100.0), "p")
    later = http.turn("p-2", "p", "small", 200.0)  # its program's place, 100, is the back
    assert later.order_s == 100.0 and http.line.order() == ["big-1", "p-2"] and not big.nudged


# --- a simulated run -----------------------------------------------------------------------


def test_compare_runs_mars_nudge_to_the_end(tmp_path):
    out = tmp_path / "out.json"
    result = CliRunner().invoke(app, ["compare", "--policies", "mars-nudge", "--qps", "12", "--duration", "30",
                                      "--nudge-m", "2", "--workers", "1", "--json", str(out)])
    assert result.exit_code == 0, result.output
    (record,) = json.loads(out.read_text())
    assert record["policy"] == "mars-nudge" and record["nudge_m"] == 2 and record["starvation"] == "off"
    assert record["num_finished"] == record["num_requests"] > 0


def test_compare_refuses_a_window_under_one():
    result = CliRunner().invoke(app, ["compare", "--policies", "mars-nudge", "--nudge-m", "0"])
    assert result.exit_code != 0 and "--nudge-m 0: give a window of 1 or more" in result.output

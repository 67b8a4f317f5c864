"""mars-boost and autellix in the vLLM plugin's queue: a conversation's turns as one program.

The plugin's objects, driven as `MarsScheduler` drives them: a turn arrives
(`ProgramLedger.turn_arrives`, then the policy starts its segment), waits in the
`RankedRequestQueue`, runs (one attained iteration per step it is scheduled in) and ends
(`turn_ends`). A turn's place in the arrival order is its program's first arrival (the simulator's
request keeps its arrival across its calls), which mars-boost ranks by and which orders MARS's
promoted lane; autellix ranks by the service its program attained over its
earlier turns, with Autellix's anti-starvation ratio over that service.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from marsched.policy import EngineLoad, RequestProgress  # noqa: E402
from marsched.policy.boost import boost_key  # noqa: E402
from marsched.policy.plas import LEVEL_SPAN_S, STARVATION_RATIO, level_of  # noqa: E402
from marsched.policy.program_rest import RestRule  # noqa: E402
from marsched.vllm.config import MarsConfig  # noqa: E402
from marsched.vllm.programs import ProgramLedger  # noqa: E402
from marsched.vllm.ranked_queue import RankedRequestQueue  # noqa: E402
from marsched.workload.model import build_request  # noqa: E402

pytestmark = pytest.mark.vllm  # the plugin's queue is a vLLM RequestQueue

CAPACITY = 10_000  # device KV tokens


class Plugin:
    """The ledger and the queue of one scheduler, with its clock and iteration count."""

    def __init__(self, policy: str, **config) -> None:
        self.policy = MarsConfig(policy=policy, **config).build_policy(token_budget=256)
        self.ledger = ProgramLedger(rest=RestRule.MEAN, program_arrival=self.policy.ranks_by_program_arrival)
        self.now, self.iteration = 0.0, 0
        self.progress: dict[str, RequestProgress] = {}
        self.queue = RankedRequestQueue(self.policy, lambda r: self.progress[r.request_id], self.load,
                                        lambda: self.iteration, lambda: self.now)

    def load(self) -> EngineLoad:
        return EngineLoad(self.now, 0, 0.01, 0, CAPACITY)

    def arrive(self, rid: str, conversation: str, at_s: float, prompt_tokens: int = 100) -> RequestProgress:
        self.now = at_s
        progress = self.progress[rid] = RequestProgress(build_request(rid, prompt_tokens, [(10, None)]), order_s=at_s)
        self.ledger.turn_arrives(conversation, progress, predicted_tokens=10)
        self.policy.start_segment(progress, self.load())
        self.queue.add_request(SimpleNamespace(request_id=rid))
        return progress

    def run(self, rid: str, steps: int, conversation: str) -> None:
        """Admitted, scheduled in `steps` steps (the scheduler counts one attained iteration each), ended."""
        progress = self.progress[rid]
        self.queue.remove_request(SimpleNamespace(request_id=rid))
        progress.attained_iterations += steps
        progress.generated = 10
        self.ledger.turn_ends(conversation, progress, last=False)

    def order(self) -> list[str]:
        return [r.request_id for r in self.queue]


def test_a_later_turn_of_an_old_program_ranks_by_the_programs_first_arrival():
    plugin = Plugin("mars-boost", boost_gamma=1.0)  # a boost of a few seconds: the arrival decides
    plugin.arrive("old-1", "old", at_s=0.0)
    plugin.run("old-1", 10, "old")
    plugin.arrive("new-1", "new", at_s=500.0)
    old = plugin.arrive("old-2", "old", at_s=1000.0, prompt_tokens=200)  # larger, and the last to arrive
    assert plugin.order() == ["old-2", "new-1"]
    assert old.order_s == 0.0 and plugin.progress["new-1"].order_s == 500.0
    load = plugin.load()
    size_s = plugin.policy.memory_time(old, load) / CAPACITY
    assert plugin.policy.queue_key(old, load) == pytest.approx(boost_key(0.0, size_s, 1.0))


def test_an_inferred_program_adopted_at_its_first_turns_end_keeps_that_turns_arrival():
    ledger = ProgramLedger(program_arrival=True)
    ledger.adopt("c", prompt_tokens=100, arrival_s=3.0)
    follow_up = RequestProgress(build_request("c-2", 150, [(10, None)]), order_s=9.0)
    ledger.turn_arrives("c", follow_up, predicted_tokens=10)
    assert follow_up.order_s == 3.0


@pytest.mark.parametrize("policy,place", [("mars", 0.0), ("infercept", 0.0), ("vllm", 7.0), ("autellix", 7.0)])
def test_a_turn_keeps_its_programs_arrival_unless_the_policy_requeues_at_the_tail(policy, place):
    # The simulator's request keeps its arrival across its calls, but where a call's end puts it
    # at the tail of the queue (vLLM's and Autellix's rule): there a turn's own arrival is its place.
    plugin = Plugin(policy)
    assert plugin.policy.ranks_by_program_arrival is (place == 0.0)
    plugin.arrive("a-1", "a", at_s=0.0)
    plugin.run("a-1", 10, "a")
    assert plugin.arrive("a-2", "a", at_s=7.0).order_s == place


def test_turns_promoted_for_life_run_in_their_programs_arrival_order():
    plugin = Plugin("mars")
    assert plugin.policy.starvation.for_life
    for conversation, at_s in (("old", 0.0), ("new", 5.0)):
        first = plugin.arrive(f"{conversation}-1", conversation, at_s=at_s)
        first.elder = True  # promoted while it waited: for the program's life
        plugin.run(f"{conversation}-1", 10, conversation)
    plugin.arrive("new-2", "new", at_s=20.0, prompt_tokens=50)
    plugin.arrive("old-2", "old", at_s=30.0, prompt_tokens=5_000)  # later and larger: first all the same
    plugin.arrive("fresh-1", "fresh", at_s=31.0, prompt_tokens=10)  # not promoted: after the lane
    assert plugin.order() == ["old-2", "new-2", "fresh-1"]


def test_attained_service_accumulates_over_a_programs_turns_and_not_across_programs():
    plugin = Plugin("autellix")
    plugin.arrive("a-1", "a", at_s=0.0)
    plugin.run("a-1", 10, "a")
    second = plugin.arrive("a-2", "a", at_s=10.0)
    fresh = plugin.arrive("b-1", "b", at_s=20.0)
    assert (second.attained_iterations, second.attained_before_segment) == (10, 10)
    assert fresh.attained_iterations == 0
    # PLAS: the program's service picks the queue; b's first call goes first though it came later.
    assert plugin.order() == ["b-1", "a-2"]
    load = plugin.load()
    assert plugin.policy.queue_key(second, load) == level_of(10, 0) * LEVEL_SPAN_S + 10.0
    assert plugin.policy.queue_key(fresh, load) == 20.0
    plugin.run("a-2", 10, "a")
    plugin.run("b-1", 1, "b")
    third = plugin.arrive("a-3", "a", at_s=30.0)
    b_second = plugin.arrive("b-2", "b", at_s=40.0)
    assert (third.attained_iterations, b_second.attained_iterations) == (20, 1)
    assert level_of(20, 0) > level_of(10, 0) > level_of(1, 0) == 0
    assert plugin.order() == ["b-2", "a-3"]


def test_autellix_promotes_a_turn_that_waited_its_ratio_times_its_programs_service():
    plugin = Plugin("autellix")
    plugin.arrive("a-1", "a", at_s=0.0)
    plugin.run("a-1", 10, "a")
    plugin.iteration = 100
    plugin.arrive("a-2", "a", at_s=1.0)
    plugin.arrive("b-1", "b", at_s=2.0)
    assert plugin.policy.starvation.per_service and plugin.policy.starvation.threshold == STARVATION_RATIO
    waits = {}
    for iteration in range(101, 200):
        for progress in plugin.queue.promote_starving(iteration, 3.0):
            waits[progress.request_id] = iteration - 100
    # Waiting 8 times its service (its program's 10 iterations; at least 1 for a new program).
    assert waits == {"b-1": STARVATION_RATIO * 1, "a-2": STARVATION_RATIO * 10}


def test_mars_nudge_swaps_in_the_plugins_queue_and_a_later_turn_keeps_its_programs_place():
    plugin = Plugin("mars-nudge", nudge_m=2)
    assert plugin.policy.ranks_by_program_arrival and plugin.ledger.program_arrival
    for i in range(30):  # first turns of prompts 100 to 3,000 tokens: the sizes the bands are learnt from
        plugin.arrive(f"seen-{i}", f"seen-{i}", at_s=float(i), prompt_tokens=100 * (i + 1))
    for i in range(30):
        plugin.run(f"seen-{i}", 1, f"seen-{i}")
    big = plugin.arrive("big-1", "big", at_s=100.0, prompt_tokens=4_000)
    small = plugin.arrive("s-1", "s", at_s=101.0, prompt_tokens=10)
    assert plugin.order() == ["s-1", "big-1"]
    assert (small.order_s, big.order_s, big.nudged) == (100.0, 101.0, True)
    plugin.run("s-1", 3, "s")
    plugin.run("big-1", 3, "big")
    later = plugin.arrive("big-2", "big", at_s=200.0, prompt_tokens=4_000)
    assert (later.order_s, later.nudged) == (101.0, True)
    assert plugin.arrive("s-2", "s", at_s=201.0, prompt_tokens=10).order_s == 100.0

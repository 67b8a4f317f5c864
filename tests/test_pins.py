"""Pins give way newest program first, by one rule (`policy/pins.py`) that the simulator's lifecycle
and the server's keeper both read: a program that arrived later loses its kept call first, however
long ago either call was kept."""

from __future__ import annotations

from marsched.lifecycle import CallLifecycle
from marsched.policy import Strategy, make_policy
from marsched.policy.pins import release_order
from marsched.vllm.retention import ConversationKeeper
from simhelpers import COST, two_segment
from test_lifecycle_driver import _HoldingEngine, _started
from test_lifecycle_parity import _Recorder
from test_retention_unpin import Block, FreeQueuePool


def test_the_latest_arrival_gives_way_first_and_a_tie_goes_by_the_larger_name():
    pins = [(0.0, "a"), (3.0, "b"), (3.0, "c"), (1.0, "d")]
    assert release_order(pins, lambda p: p) == [(3.0, "c"), (3.0, "b"), (1.0, "d"), (0.0, "a")]
    assert release_order([], lambda p: p) == []


def test_the_server_releases_the_newest_programs_pin_though_it_was_kept_last():
    pool = FreeQueuePool()
    keeper = ConversationKeeper(pool, 4, None)
    old, new = [Block(i) for i in range(2)], [Block(i) for i in range(2, 4)]
    # The old program (first turn at 0 s) kept its call at 5 s; the new one (at 3 s) kept its call at 1 s.
    assert keeper.keep("old", "r-old", list(range(8)), 8, old, Strategy.PRESERVE, 5.0, 60.0, 0.0) is not None
    assert keeper.keep("new", "r-new", list(range(8)), 8, new, Strategy.PRESERVE, 1.0, 60.0, 3.0) is not None
    pool.free_blocks(list(reversed(old)) + list(reversed(new)))  # the turns' own references are gone
    assert keeper.relieve(0, 2) == 1
    assert list(keeper.kept) == ["old"] and all(b.ref_cnt == 0 for b in new)
    assert keeper.relieve(0, 2) == 1 and not keeper.kept


def test_a_pin_of_a_program_not_followed_counts_as_arriving_when_kept():
    pool = FreeQueuePool()
    keeper = ConversationKeeper(pool, 4, None)
    blocks = [Block(i) for i in range(4)]
    keeper.keep("known", "r1", list(range(8)), 8, blocks[:2], Strategy.PRESERVE, 2.0, 60.0, 4.0)
    keeper.keep("unknown", "r2", list(range(8)), 8, blocks[2:], Strategy.PRESERVE, 3.0, 60.0)
    pool.free_blocks(blocks)
    assert keeper.kept["unknown"].program_arrival_t == 3.0
    keeper.relieve(0, 1)
    assert list(keeper.kept) == ["unknown"]  # the known program arrived later (4 s) than 3 s


class _Moves(_HoldingEngine):
    def __init__(self) -> None:
        super().__init__(set())
        self.discarded: list[str] = []

    def discard(self, handle):
        self.discarded.append(handle.progress.request_id)


def test_the_simulator_releases_the_newest_programs_call_first():
    policy = make_policy("continuum", COST)
    engine = _Moves()
    queue = type("Q", (), {"threshold": lambda self, now: None})()
    driver = CallLifecycle(policy, queue, engine, _Recorder(), handle_of=lambda rid: None)
    handles = {rid: _started(policy, two_segment(rid, 0.0, 10, 3, 0.5, 2, 1)) for rid in ("early", "late", "mid")}
    for rid, arrival in (("early", 0.0), ("late", 9.0), ("mid", 4.0)):
        handles[rid].progress.order_s = arrival
        handles[rid].strategies.append(Strategy.PRESERVE.value)  # its call began preserved
    driver.paused_preserved.update(handles)
    assert driver.release_pinned() and driver.release_pinned()
    assert engine.discarded == ["late", "mid"] and list(driver.paused_preserved) == ["early"]

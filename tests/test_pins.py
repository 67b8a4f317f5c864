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


def test_the_server_frees_only_what_the_head_needs_counting_blocks_no_other_request_holds():
    pool = FreeQueuePool()
    keeper = ConversationKeeper(pool, 4, None)
    blocks = {name: [Block(10 * i), Block(10 * i + 1)] for i, name in enumerate(("a", "b", "c", "claimed"))}
    for arrival, name in enumerate(("a", "b", "c", "claimed")):
        keeper.keep(name, "r-" + name, list(range(8)), 8, blocks[name], Strategy.PRESERVE, 0.0, 60.0, float(arrival))
    keeper.claim("claimed", "f", list(range(9)), 1.0)  # its follow-up arrived: not a pin to give up
    pool.free_blocks([b for name in ("a", "b", "c", "claimed") for b in blocks[name]])
    blocks["b"][0].ref_cnt += 1  # another request holds one of b's blocks: releasing b frees one
    assert keeper.relieve(0, 3, head_rid="f") == 2  # c (2 blocks), then b (1): 3
    assert list(keeper.kept) == ["a"] and keeper.stats.released == 2
    assert all(b.ref_cnt == 1 for b in blocks["claimed"])  # the claimed turn, newest, kept its pin
    assert [b.ref_cnt for b in blocks["b"]] == [1, 0] and keeper.stats.yielded == 0


def test_waiting_follow_ups_yield_the_longest_kept_first_and_only_until_the_head_fits():
    pool = FreeQueuePool()
    keeper = ConversationKeeper(pool, 4, None)
    blocks = {name: [Block(10 * i + j) for j in range(3)] for i, name in enumerate(("head", "x", "y"))}
    # The head's own claim is the longest kept; x's follow-up id sorts after y's, though x was kept first.
    for kept_t, name, follow_up in ((0.0, "head", "f-head"), (1.0, "x", "f-9"), (3.0, "y", "f-1")):
        keeper.keep(name, "r-" + name, list(range(12)), 12, blocks[name], Strategy.PRESERVE, kept_t, 60.0)
        keeper.claim(name, follow_up, list(range(13)), kept_t + 0.5)
    pool.free_blocks([b for name in ("head", "x", "y") for b in blocks[name]])
    for b in blocks["x"][1:]:
        b.ref_cnt += 1  # shared with another request: unpinning x frees one block of three
    assert keeper.relieve(2, 4, head_rid="f-head") == 2  # 2 free + x's one, short of 4: y too
    assert [b.ref_cnt for b in blocks["x"]] == [0, 1, 1] and all(b.ref_cnt == 0 for b in blocks["y"])
    assert keeper.stats.yielded == 2 and all(b.ref_cnt == 1 for b in blocks["head"])  # never the head's own
    later = [Block(90), Block(91)]
    keeper.keep("z", "r-z", list(range(4)), 4, later[:1], Strategy.PRESERVE, 5.0, 60.0)
    keeper.claim("z", "f-z", list(range(5)), 5.5)
    keeper.keep("w", "r-w", list(range(4)), 4, later[1:], Strategy.PRESERVE, 6.0, 60.0)
    keeper.claim("w", "f-w", list(range(5)), 6.5)
    pool.free_blocks(later)
    assert keeper.relieve(2, 3, head_rid="f-head") == 1 and keeper.stats.yielded == 3  # z's one block was enough
    assert "f-w" in keeper.claims and keeper.reusable("f-w") == 4


def test_with_nothing_pinned_the_simulator_releases_nothing_and_a_release_is_a_discard_at_the_call():
    policy = make_policy("continuum", COST)
    engine = _Moves()
    trace = _Recorder()
    driver = CallLifecycle(policy, type("Q", (), {"threshold": lambda self, now: None})(), engine, trace,
                           handle_of=lambda rid: None)
    assert driver.release_pinned() is False
    handle = _started(policy, two_segment("p", 0.0, 10, 3, 0.5, 2, 1))
    handle.strategies.append(Strategy.PRESERVE.value)
    driver.paused_preserved["p"] = handle
    assert driver.release_pinned() and handle.strategies == [Strategy.DISCARD.value]
    assert [e.get("strategy") for e in trace.events if "strategy" in e] == [Strategy.DISCARD.value]  # only the release
    assert engine.discarded == ["p"]

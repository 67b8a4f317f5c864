"""What the simulator does to a request's KV cache and its clock, checked on small hand-sized runs.

Every scenario here is deterministic and small enough to follow by hand with the test
engine of `simhelpers` (16-token blocks, `t(n) = 10 ms + 0.05 ms·n`, a 128-token
budget, a 20,000 tokens/s host link); the numbers in the assertions are worked out in
the comments beside them, not taken from a run.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from marsched.metrics.trace import EventTrace
from marsched.policy import CostModel, WaitingQueue, make_policy
from marsched.policy.load import EngineLoad
from marsched.policy.policy import StarvationClock, StarvationConfig
from marsched.policy.progress import RequestProgress
from marsched.sim.engine import Simulator
from marsched.sim.select import make_simulator
from marsched.sim.profile import Profile
from simhelpers import COST, single, small_profile, two_segment


def t(tokens: int) -> float:
    """The test engine's iteration time, written out: 10 ms + 0.05 ms per token."""
    return 0.01 + 5e-5 * tokens


class Recorder(EventTrace):
    """Keeps every event in memory (times unrounded); `watch` sees each one as it is emitted."""

    enabled = True

    def __init__(self, watch=None) -> None:
        self.events: list[dict] = []
        self.watch = watch

    def emit(self, event: str, t: float, rid: str | None = None, **fields) -> None:
        record = {"event": event, "t": t, "rid": rid, **fields}
        self.events.append(record)
        if self.watch:
            self.watch(record)


def _run(requests, policy, profile, watch=None, simulator=make_simulator):
    """Run to the end; `watch(simulator, event)` is called at every event."""
    holder: dict[str, Simulator] = {}
    trace = Recorder((lambda event: watch(holder["sim"], event)) if watch else None)
    sim = simulator(requests, profile, policy, trace=trace)
    holder["sim"] = sim
    result = sim.run()
    return sim, result, trace.events


def _events(events, rid, kind):
    return [e for e in events if e["rid"] == rid and e["event"] == kind]


def _tokens_processed(events) -> int:
    return sum(e["tokens"] * e["iterations"] for e in events if e["event"] == "schedule")


def _finish(events, rid) -> float:
    return _events(events, rid, "finish")[0]["t"]


# --- 1. a request that lost its KV cache prefills its whole context again ---------------


def test_preempted_request_recomputes_its_whole_context():
    # 6 blocks = 96 tokens. A (40-token prompt, 30 out) and B (30, 30) both decode until the
    # device is full; A, the earlier arrival, then needs a block and preempts B, the
    # lowest-ranked under FCFS. B had generated 8 tokens: context 38, 37 of them computed.
    requests = [single("A", 0.0, 40, 30), single("B", 0.001, 30, 30)]
    at_preempt: dict[str, int] = {}
    at_admit: list[tuple[int, int, int]] = []

    def watch(sim, event):
        if event["rid"] != "B" or event["event"] not in ("preempt", "admit"):
            return
        progress = sim.live["B"].progress
        if event["event"] == "preempt":  # emitted before the KV is released
            at_preempt.update(context=progress.context_tokens, computed=progress.computed_tokens)
        if event["event"] == "admit":  # emitted before the admitted tokens are computed
            at_admit.append((event["prefill_tokens"], progress.context_tokens, progress.computed_tokens))

    _, result, events = _run(requests, make_policy("preserve", COST), small_profile(device_blocks=6), watch)
    assert [e["rid"] for e in events if e["event"] == "preempt"] == ["B"]
    assert at_preempt == {"context": 38, "computed": 37}
    # Re-admitted with nothing on the device: all 38 tokens are prefilled again, not just the last one.
    assert at_admit[1] == (38, 38, 0)
    # Tokens run through the model: each request's prompt + (output − 1) decode steps, plus the
    # 37 tokens of B's KV that were lost and recomputed (38 prefilled where 1 would have been).
    assert _tokens_processed(events) == (40 + 29) + (30 + 29) + 37
    # A finishes first (iterations of 40, 31, then 7 × 2 and 21 × 1 tokens); B is re-admitted at
    # that moment, prefills 38 tokens, then decodes its last 30 − 8 − 1 = 21 tokens alone.
    finish_a = t(40) + t(31) + 7 * t(2) + 21 * t(1)
    assert _finish(events, "A") == pytest.approx(finish_a)
    assert _finish(events, "B") == pytest.approx(finish_a + t(38) + 21 * t(1))
    assert next(r for r in result.records if r.request_id == "B").preemptions == 1


@pytest.mark.parametrize("policy_name", ["discard", "vllm"])
def test_discarded_call_recomputes_the_whole_context_after_it_returns(policy_name):
    # 50-token prompt, 20 tokens, a 0.2 s call returning 10 tokens, 10 more tokens. At the call
    # the context is 70 (69 computed); Discard frees it, so after the return all 70 + 10 = 80
    # tokens are prefilled again.
    request = two_segment("D", 0.0, 50, 20, 0.2, 10, 10)
    at_admit: list[tuple[int, int]] = []

    def watch(sim, event):
        if event["event"] == "admit":
            at_admit.append((event["prefill_tokens"], sim.live["D"].progress.computed_tokens))

    sim, _, events = _run([request], make_policy(policy_name, COST), small_profile(), watch)
    assert _events(events, "D", "api_start")[0]["strategy"] == "discard"
    assert _events(events, "D", "api_start")[0]["context_tokens"] == 69  # as it was at the call, before the discard
    assert _events(events, "D", "resume")[0]["where"] == "waiting"
    assert at_admit == [(50, 0), (80, 0)]
    assert _tokens_processed(events) == (50 + 19) + 80 + 9
    call_start = t(50) + 19 * t(1)
    assert _events(events, "D", "api_start")[0]["t"] == pytest.approx(call_start)
    assert _finish(events, "D") == pytest.approx(call_start + 0.2 + t(80) + 9 * t(1))
    assert sim.device.used == 0


# --- 5. queue keys that follow the load are recomputed when it moves --------------------


def test_queue_keys_are_recomputed_when_the_iteration_time_moves():
    # MARS keys, single segments (prefill Tfwd(P)·P + decode τ·(L·P + L(L+1)/2)):
    #   X: 10-token prompt, 200 out: Tfwd(10)·10 = 0.105;  τ·(2000 + 20100) = 22100·τ
    #   Y: 500-token prompt, 1 out:  Tfwd(500) = 3·t(128) + t(116) = 0.065, ·500 = 32.5;  501·τ
    # X goes first at τ = 1 ms (22.205 < 33.001), Y at τ = 10 ms (37.51 < 221.105); they cross at
    # τ = 32.395 / 21599 ≈ 1.5 ms.
    policy = make_policy("mars", COST, starvation_threshold=None)
    queue = WaitingQueue(policy)

    def load(tau):
        return EngineLoad(now_s=0.0, running_kv_tokens=0, iteration_s=tau, host_free_tokens=10**9)

    for request in (single("X", 0.0, 10, 200), single("Y", 0.0, 500, 1)):
        progress = RequestProgress(request, order_s=0.0)
        policy.start_segment(progress, load(0.001))
        queue.push(progress, load(0.001), iteration=0)
    assert policy.queue_key(next(queue.ordered()), load(0.001)) == pytest.approx(0.105 + 22100 * 0.001)
    assert [p.request_id for p in queue.ordered()] == ["X", "Y"]
    assert queue.refresh(load(0.001), iteration=1)  # the first refresh always computes
    # A 4% move is within the 5% tolerance: keys are kept.
    assert not queue.refresh(load(0.00104), iteration=2)
    assert [p.request_id for p in queue.ordered()] == ["X", "Y"]
    # τ ten times larger: the decode triangle dominates and the order turns over.
    assert queue.refresh(load(0.01), iteration=3)
    assert [p.request_id for p in queue.ordered()] == ["Y", "X"]
    assert queue.pop(iteration=3, now_s=0.0).request_id == "Y"
    assert queue.pop(iteration=3, now_s=0.0).request_id == "X"


def test_queue_keys_wait_for_the_refresh_interval():
    policy = make_policy("mars", COST, starvation_threshold=None, refresh_interval=5)
    queue = WaitingQueue(policy)
    slow = EngineLoad(now_s=0.0, running_kv_tokens=0, iteration_s=0.01, host_free_tokens=10**9)
    assert queue.refresh(slow, iteration=10)
    # τ moved tenfold, but only 4 iterations have passed: the keys wait.
    assert not queue.refresh(dataclasses.replace(slow, iteration_s=0.1), iteration=14)
    assert queue.refresh(dataclasses.replace(slow, iteration_s=0.1), iteration=15)


# --- 6. running identical decode iterations together changes nothing ---------------------


class _OneIterationAtATime(Simulator):
    """Test-only: never run identical iterations together, the reference the fast path must match."""

    def _identical_iterations(self, running, dt, growth):
        return 1


_SLOW_LINK = CostModel(seconds_per_token=5e-5, seconds_per_iteration=0.01, token_budget=128, swap_tokens_per_s=2_000)

def _with_starvation(policy, config):
    """The named policy with an explicit starvation rule, whatever the registry's default for it."""
    policy.starvation = config
    return policy


# Every iteration takes exactly 1/64 s whatever its tokens, so event times are exact in binary.
_DYADIC = CostModel(seconds_per_token=0.0, seconds_per_iteration=1 / 64, token_budget=128, swap_tokens_per_s=20_000)


def _near_boundary_workload():
    return [single("H", 0.0, 30, 40), single("X1", 4 / 64, 20, 10), single("X2", 5.5 / 64, 20, 10),
            single("X3", 8.5 / 64, 20, 10)]


# Each scenario has one kind of event fall in the middle of a stretch of pure decode.
_FAST_FORWARD_SCENARIOS = {
    # H fills the 8 blocks while W1 and W2 wait; with θ = 5 iterations each is promoted 5
    # iterations after it arrived, while H is still decoding (H ends about 0.5 s later).
    "promotion": (
        lambda: [single("H", 0.0, 60, 60), single("W1", 0.05, 70, 5), single("W2", 0.08, 70, 5)],
        small_profile(device_blocks=8),
        lambda: _with_starvation(make_policy("preserve", COST), StarvationConfig(5)),
        "promote",
    ),
    # X arrives while H decodes and fits at once.
    "arrival": (
        lambda: [single("H", 0.0, 60, 40), single("X", 0.1234, 20, 10)],
        small_profile(),
        lambda: make_policy("mars", COST),
        "arrive",
    ),
    # A's preserved call returns while H decodes, and A joins the batch again.
    "call return": (
        lambda: [single("H", 0.0, 60, 40), two_segment("A", 0.0, 20, 5, 0.0777, 3, 10)],
        small_profile(),
        lambda: make_policy("preserve", COST),
        "api_end",
    ),
    # S's 104 tokens take 52 ms each way on a 2,000 tokens/s link: about 5 decode iterations of H.
    "transfer": (
        lambda: [single("H", 0.0, 30, 60), two_segment("S", 0.0, 100, 5, 0.3, 3, 10)],
        Profile("slow-link", "test engine, slow host link", 1.0, 12, 16, 16, _SLOW_LINK),
        lambda: make_policy("swap", _SLOW_LINK),
        "swap_out",
    ),
    # Arrivals exactly on an iteration boundary, within one iteration and within two (exact binary
    # times: see `test_fast_forward_stops_at_each_event_near_an_iteration_boundary`).
    "near boundaries": (
        lambda: _near_boundary_workload(),
        Profile("dyadic", "test engine, 1/64 s per iteration", 1.0, 64, 16, 16, _DYADIC),
        lambda: make_policy("preserve", _DYADIC),
        "admit",
    ),
}


def _same(a, b) -> bool:
    """Equal, floats within 1e-9 (nested too: an admit event's key basis holds τ)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(value, b[key]) for key, value in a.items())
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=0, abs_tol=1e-9)
    return a == b


@pytest.mark.parametrize("scenario", list(_FAST_FORWARD_SCENARIOS))
def test_fast_forward_gives_the_same_run_as_one_iteration_at_a_time(scenario):
    workload, profile, policy, mid_decode_event = _FAST_FORWARD_SCENARIOS[scenario]
    _, fast, fast_events = _run(workload(), policy(), profile)
    _, slow, slow_events = _run(workload(), policy(), profile, simulator=_OneIterationAtATime)
    # The scenario means something: decode iterations were run together, and the event is there.
    assert fast.steps < fast.iterations and slow.steps == slow.iterations
    assert any(e["event"] == mid_decode_event for e in fast_events)
    assert fast.iterations == slow.iterations
    assert fast.end_s == pytest.approx(slow.end_s, abs=1e-9)
    # Every event but `schedule` (whose `iterations` field is the point of the fast path), in order.
    fast_trace = [e for e in fast_events if e["event"] != "schedule"]
    slow_trace = [e for e in slow_events if e["event"] != "schedule"]
    assert len(fast_trace) == len(slow_trace)
    for fast_event, slow_event in zip(fast_trace, slow_trace):
        assert _same(fast_event, slow_event), (fast_event, slow_event)
    assert len(fast.records) == len(slow.records)
    for fast_record, slow_record in zip(fast.records, slow.records):
        assert _same(dataclasses.asdict(fast_record), dataclasses.asdict(slow_record)), (fast_record, slow_record)


def test_promotion_happens_mid_decode_at_the_threshold():
    # The promotion scenario by hand: H prefills 60 tokens at t = 0 and decodes alone from
    # t(60) = 13 ms, one 10.05 ms iteration each. W1 arrives at 50 ms and is taken in at the start
    # of iteration 5 (13 + 4·10.05 = 53.2 ms); with θ = 5 it is promoted 5 iterations later, at
    # 53.2 + 5·10.05 = 103.45 ms, while H still decodes (H finishes at 13 + 59·10.05 = 605.95 ms).
    workload, profile, policy, _ = _FAST_FORWARD_SCENARIOS["promotion"]
    _, _, events = _run(workload(), policy(), profile)
    arrive = _events(events, "W1", "arrive")[0]["t"]
    assert arrive == pytest.approx(t(60) + 4 * t(1))
    assert _events(events, "W1", "promote")[0]["t"] == pytest.approx(arrive + 5 * t(1))
    assert _finish(events, "H") == pytest.approx(t(60) + 59 * t(1))


def test_fast_forward_stops_at_each_event_near_an_iteration_boundary():
    # Iteration k runs from k/64 s to (k+1)/64 s. H (30-token prompt, 40 out) prefills in
    # iteration 0 and decodes from iteration 1.
    # - X1 arrives at exactly 4/64: from 1/64 three decode iterations run together, and X1 is
    #   taken in at 4/64, not one iteration later.
    # - X2 arrives at 5.5/64, within the first iteration of the decode stretch from 5/64: that
    #   stretch is one iteration long, and X2 comes in at 6/64.
    # - X3 arrives at 8.5/64, in the second iteration of the stretch from 7/64: two iterations
    #   run together, and X3 comes in at 9/64.
    # Then each X (10 tokens: 1 at its prefill, 9 decoded) ends the stretch it finishes in:
    # X1 decodes in iterations 5–13, X2 in 7–15, X3 in 10–18, H (39 decoded) in 1–39.
    workload, profile, policy, _ = _FAST_FORWARD_SCENARIOS["near boundaries"]
    _, result, events = _run(workload(), policy(), profile)
    admitted = {e["rid"]: e["t"] * 64 for e in events if e["event"] == "admit"}
    assert admitted == {"H": 0, "X1": 4, "X2": 6, "X3": 9}
    stretches = [(e["t"] * 64, e["iterations"]) for e in events if e["event"] == "schedule"]
    assert stretches == [(0, 1), (1, 3), (4, 1), (5, 1), (6, 1), (7, 2), (9, 1), (10, 4), (14, 2), (16, 3), (19, 21)]
    assert {r.request_id: r.finish_s * 64 for r in result.records} == {"X1": 14, "X2": 16, "X3": 19, "H": 40}
    assert result.iterations == 40 and result.steps == len(stretches)


def test_fast_forward_runs_until_the_blocks_run_out():
    # The preemption scenario of the first test: after A's prefill (iteration 0) and B's (1), A has
    # 41 tokens computed in 3 blocks, B 30 in 2, and 1 block is free. Decode iterations run together
    # while the growth fits that block: B takes it at its 33rd token (3 iterations in) and A needs a
    # 4th block at its 49th (8 in), so 7 iterations run at once; then A preempts B and runs alone
    # (1 iteration, then the 20 left to its end), and B prefills 38 tokens and decodes its last 21.
    requests = [single("A", 0.0, 40, 30), single("B", 0.001, 30, 30)]
    _, result, events = _run(requests, make_policy("preserve", COST), small_profile(device_blocks=6))
    assert [e["iterations"] for e in events if e["event"] == "schedule"] == [1, 1, 7, 1, 20, 1, 21]
    assert result.iterations == 52


def test_fast_forward_takes_the_longest_stretch_the_blocks_allow_before_an_event():
    # 4 blocks, 1/64 s per iteration. H (30-token prompt) and G (17) prefill together in iteration 0
    # and hold 2 blocks each: nothing is free. X arrives at 4.5/64, so the decode stretch from 1/64
    # could last 4 iterations; H's KV reaches 32 tokens, the end of its 2nd block, after 2, and its
    # 33rd token needs a block that is not there. So exactly 2 iterations run together, and at
    # 3/64 a request is preempted to make room.
    requests = [single("H", 0.0, 30, 20), single("G", 0.0, 17, 10), single("X", 4.5 / 64, 5, 3)]
    profile = Profile("dyadic", "test engine, 1/64 s per iteration", 1.0, 4, 16, 16, _DYADIC)
    _, _, events = _run(requests, make_policy("preserve", _DYADIC), profile)
    stretches = [(e["t"] * 64, e["iterations"]) for e in events if e["event"] == "schedule"]
    assert stretches[:3] == [(0, 1), (1, 2), (3, 1)]
    assert [e["t"] * 64 for e in events if e["event"] == "preempt"][:1] == [3]


# --- 9. a call that returns while its KV is still being copied out -------------------------


def test_call_returning_during_swap_out_keeps_the_device_copy_and_frees_the_host_blocks():
    # S: a 100-token prompt and 5 tokens, then a 1 ms call. At the call 104 tokens are computed,
    # in 7 blocks; copying them out takes 104 / 20,000 = 5.2 ms, longer than the call. Nothing
    # else runs, so the engine idles to the next event: the call's return, 1 ms in.
    request = two_segment("S", 0.0, 100, 5, 0.001, 3, 5)
    at_return: dict[str, object] = {}

    def watch(sim, event):
        if event["event"] == "resume":  # the end of the return's handling
            sim.check_invariants()
            held = sim.live["S"]
            at_return.update(where=event["where"], device_blocks=held.device_blocks, host_blocks=held.host_blocks,
                             device_used=sim.device.used, host_used=sim.host.used, transfers=len(sim.link_out))

    sim, result, events = _run([request], make_policy("swap", COST), small_profile(), watch)
    call = _events(events, "S", "api_start")[0]
    assert call["strategy"] == "swap" and call["context_tokens"] == 104
    assert 104 / COST.swap_tokens_per_s > 0.001  # the transfer outlasts the call
    assert _events(events, "S", "api_end")[0]["t"] == pytest.approx(call["t"] + 0.001)
    # The device copy is intact, so the request runs on from it; the host copy is dropped.
    assert at_return == {"where": "device", "device_blocks": 7, "host_blocks": 0,
                         "device_used": 7, "host_used": 0, "transfers": 0}
    assert not _events(events, "S", "swap_out") and not _events(events, "S", "swap_in")
    assert not [e for e in events if e["event"] == "admit" and e["segment"] == 1]
    assert sim.device.used == 0 and sim.host.used == 0
    assert result.records[0].strategies == ("swap",)


# --- a promotion due while the engine idles ---------------------------------------------------


def test_seconds_clock_promotion_due_while_idle_does_not_stall():
    # P keeps its 105 tokens (7 of 8 blocks) on the device through a 2 s call; W (60 tokens)
    # arrives at 0.6 s and cannot fit, and nothing runs, so the engine idles to the next event:
    # W's promotion, due at 0.6 + 0.1 s. Engine time then reads 0.7 but 0.7 − 0.6 < 0.1 in
    # floating point: unless the promotion takes that as reached, W is not promoted, the next
    # event is again "now", and the engine idles 0 s at a time forever (the guard stops it).
    policy = _with_starvation(make_policy("preserve", COST), StarvationConfig(0.1, clock=StarvationClock.SECONDS))
    requests = [two_segment("P", 0.0, 100, 5, 2.0, 2, 5), single("W", 0.6, 60, 5)]
    steps = []

    def guard(sim):
        steps.append(sim.now)
        if len(steps) > 1000:
            raise AssertionError(f"no progress: 1000 steps, engine time {sim.now!r}")

    result = Simulator(requests, small_profile(device_blocks=8), policy, on_step=guard).run()
    assert len(result.records) == 2



# --- the closed forms behind running identical iterations together ------------------------


def test_iterations_to_reach_is_the_fewest_whose_series_reaches_the_event():
    """`_iterations_to_reach` against its definition, counted one iteration at a time, with events on
    and beside iteration boundaries (where the closed-form estimate is off by one and is settled)."""
    from marsched.sim.stretch import iterations_to_reach as _iterations_to_reach, series as _series

    def counted(seconds, first, growth):
        target = seconds - 1e-9 * first
        n = 1
        while _series(first, growth, n) < target:
            n += 1
        return n

    checked = 0
    for first in (0.001, 0.0123, 0.0371):
        for growth in (5e-8, 1e-5, 2.5e-4):
            for k in range(1, 120, 7):
                boundary = _series(first, growth, k)
                for offset in (0.0, 1e-12, -1e-12, 1e-9 * first, -1e-9 * first, 1e-8, 0.5 * first, -0.5 * first, 1e-15):
                    seconds = boundary + offset
                    assert _iterations_to_reach(seconds, first, growth) == counted(seconds, first, growth), \
                        (seconds, first, growth)
                    checked += 1
    assert checked > 1000
    # Events a hair past a boundary, where the estimate falls one short and is settled upwards.
    for seconds, first, growth in ((0.04404730000100083, 0.001, 5e-08), (1.8618635000050099, 0.005, 1e-07),
                                   (8.5364340000371, 0.0371, 3e-06), (0.16068000001230004, 0.0123, 1e-05),
                                   (3.365628000010001, 0.01, 1e-07)):
        assert _iterations_to_reach(seconds, first, growth) == counted(seconds, first, growth), (seconds, first, growth)
    assert _iterations_to_reach(1e-6, 0.01, 1e-5) == 1  # an event inside the first iteration
    assert _iterations_to_reach(0.0, 0.01, 1e-5) == 1  # an event due now: one iteration still runs


def test_moving_average_in_closed_form_equals_the_updates_one_at_a_time():
    from marsched.lifecycle.tau import KEEP as _TAU_KEEP, moving_average as _moving_average

    for tau, first, growth, iterations in ((0.02, 0.01, 0.0, 5), (0.02, 0.01, 1e-4, 1), (0.02, 0.01, 1e-4, 2),
                                           (0.005, 0.01, 3e-5, 3), (0.02, 0.013, 2e-4, 57), (0.01, 0.01, 1e-6, 400)):
        expected = tau
        for i in range(iterations):
            expected = _TAU_KEEP * expected + (1 - _TAU_KEEP) * (first + i * growth)
        assert _moving_average(tau, first, growth, iterations) == pytest.approx(expected, rel=1e-12, abs=1e-15), \
            (tau, first, growth, iterations)


# --- engine accounting that mutation testing found unchecked -------------------------------


def test_a_request_preempted_twice_records_two_preemptions():
    requests = [single(f"s{i}", 0.01 * i, 30 + 5 * i, 40) for i in range(6)]
    _, result, events = _run(requests, make_policy("vllm", COST), small_profile(device_blocks=8))
    counted = {r.request_id: r.preemptions for r in result.records}
    for rid, preemptions in counted.items():
        assert preemptions == len(_events(events, rid, "preempt")), rid
    assert max(counted.values()) == 2


def test_the_budget_left_by_a_prefill_chunk_admits_the_next_request_with_one_token():
    # A's 127-token prompt leaves one token of the 128-token budget: B starts its prefill with it.
    requests = [single("A", 0.0, 127, 5), single("B", 0.0, 10, 5)]
    _, _, events = _run(requests, make_policy("vllm", COST), small_profile())
    first = next(e for e in events if e["event"] == "schedule")
    assert first["tokens"] == COST.token_budget == 128
    assert _events(events, "A", "admit")[0]["prefill_tokens"] == 127
    assert _events(events, "B", "admit")[0]["prefill_tokens"] == 1
    assert all(e["tokens"] <= COST.token_budget for e in events if e["event"] == "schedule")


def _sim_with_running(policy, profile, *running):
    """A simulator (not run) whose batch is `running`: (request, device blocks) pairs, segments started."""
    from marsched.sim.engine import Phase, SimRequest
    load = EngineLoad(now_s=0.0, running_kv_tokens=0, iteration_s=0.01, host_free_tokens=10**9)
    sim = Simulator([], profile, policy)
    for request, blocks in running:
        progress = RequestProgress(request, order_s=request.arrival_s)
        policy.start_segment(progress, load)
        sim_request = SimRequest(progress, phase=Phase.RUNNING, device_blocks=blocks)
        sim.device.allocate(blocks)
        sim.running.append(sim_request)
        sim.live[request.request_id] = sim_request
    return sim


def test_admission_counts_the_device_kv_held_outside_the_batch():
    """MARS admission: the running request and the candidate peak at 432 tokens together (with a
    block each for rounding); on 1024 tokens of device, 37 blocks held outside the batch (a
    preserved call, a transfer) leave room for it and 38 do not."""
    from marsched.sim.engine import SimRequest
    policy = make_policy("mars", COST)
    for outside, admitted in ((37, True), (38, False)):
        sim = _sim_with_running(policy, small_profile(device_blocks=64), (single("a", 0.0, 100, 100), 7))
        sim.device.allocate(outside)
        candidate = RequestProgress(single("b", 0.0, 100, 100), order_s=0.0)
        policy.start_segment(candidate, EngineLoad(0.0, 0, 0.01, 10**9))
        assert sim._admissible(SimRequest(candidate)) is admitted, outside


def test_a_protected_request_is_never_the_victim():
    policy = make_policy("mars", COST)
    sim = _sim_with_running(policy, small_profile(), (single("long", 0.0, 300, 300), 19),
                            (single("short", 0.0, 10, 5), 1))
    long_, short = sim.running
    assert sim._victim(short) is long_  # the lowest-ranked
    policy.protect(long_.progress, iteration=0)
    assert sim._victim(short) is short
    policy.protect(short.progress, iteration=0)
    assert sim._victim(long_) is long_  # none unprotected: the requester


def test_a_request_that_fits_only_at_its_longest_is_taken_and_one_that_does_not_is_refused():
    # 4 blocks of 16: the KV at a request's longest (its final context plus the token it samples) <= 64.
    fits = single("fits", 0.0, 60, 3)
    too_long = single("too-long", 0.0, 60, 4)
    assert fits.final_context_tokens + 1 == 64 and too_long.final_context_tokens + 1 == 65
    profile = small_profile(device_blocks=4)
    _, result, _ = _run([fits], make_policy("vllm", COST), profile)
    assert [r.request_id for r in result.records] == ["fits"]
    with pytest.raises(ValueError) as error:
        Simulator([too_long], profile, make_policy("vllm", COST))
    assert str(error.value) == ("request 'too-long' needs 5 KV blocks at its longest, "
                                "more than the 4 the profile 'small' has")


def test_progress_callback_wallclock_and_the_run_and_assignment_events():
    calls = []
    trace = Recorder()
    sim = Simulator([single("a", 0.0, 10, 5), two_segment("b", 0.0, 20, 5, 0.1, 5, 5)], small_profile(),
                    make_policy("mars", COST), trace=trace, on_progress=lambda done, total: calls.append((done, total)))
    result = sim.run()
    assert calls and calls[-1] == (2, 2) and all(total == 2 for _, total in calls)
    assert [done for done, _ in calls] == sorted(done for done, _ in calls)
    assert 0.0 <= result.wallclock_s < 60.0
    run = next(e for e in trace.events if e["event"] == "run")
    assert run["engine"] == "sim"
    assignments = [e for e in trace.events if e["event"] == "assign_strategy"]
    assert assignments and all(e["segment"] == 0 for e in assignments if e["rid"] == "b")


def test_the_iteration_time_average_after_identical_iterations_run_together_is_the_one_at_a_time_one():
    cost = dataclasses.replace(COST, seconds_per_context_token=2e-6)  # each decode iteration a little longer
    requests = [single("H", 0.0, 60, 40), single("X", 0.1234, 20, 10)]
    fast, fast_result, _ = _run(requests, make_policy("mars", cost), small_profile())
    slow, slow_result, _ = _run(requests, make_policy("mars", cost), small_profile(), simulator=_OneIterationAtATime)
    assert fast_result.steps < slow_result.steps  # identical iterations did run together
    assert fast.tau.seconds == pytest.approx(slow.tau.seconds, rel=1e-9)


def test_a_swap_in_takes_exactly_the_free_device_blocks():
    from marsched.sim.engine import Phase, SimRequest
    policy = make_policy("swap", COST)
    sim = _sim_with_running(policy, small_profile(device_blocks=7))
    load = EngineLoad(now_s=0.0, running_kv_tokens=0, iteration_s=0.01, host_free_tokens=10**9)
    swapped = []
    for rid, blocks in (("fits", 7), ("late", 1)):
        progress = RequestProgress(two_segment(rid, 0.0, 100, 5, 1.0, 2, 5), order_s=0.0)
        policy.start_segment(progress, load)
        swapped.append(SimRequest(progress, phase=Phase.SWAPPED, host_blocks=blocks))
    fits, late = swapped
    assert sim._start_swap_in(fits) and fits.phase is Phase.SWAPPING_IN and sim.device.free == 0
    assert not sim._start_swap_in(late) and late.phase is Phase.SWAPPED


def test_the_host_link_moves_less_than_a_token_and_completes_an_empty_transfer_at_once():
    from marsched.sim.link import HostLink
    link = HostLink(20_000.0)
    partial = link.start("a", 10, 1)
    assert link.advance(0.5 / 20_000) == []  # half a token
    assert partial.tokens_left == pytest.approx(9.5)
    empty_link = HostLink(20_000.0)
    empty = empty_link.start("b", 0, 0)
    assert empty_link.advance(0.0) == [empty]


@pytest.mark.parametrize("starvation", ["iterations", "age"])
def test_admitting_a_promoted_request_protects_it(starvation):
    from marsched.sim.engine import SimRequest
    policy = make_policy("mars", COST, starvation=starvation)
    sim = _sim_with_running(policy, small_profile())
    progress = RequestProgress(single("p", 0.0, 10, 5), order_s=0.0)
    policy.start_segment(progress, EngineLoad(0.0, 0, 0.01, 10**9))
    progress.promoted = True
    progress.elder = policy.starvation.for_life
    sim._leave_queue(SimRequest(progress), 10)
    assert policy.is_protected(progress, sim.iteration + 1)
    assert not progress.promoted


def test_a_finished_request_leaves_the_fcfs_wait_estimate():
    requests = [single(f"r{i}", 0.01 * i, 40, 20) for i in range(4)]
    sim, result, _ = _run(requests, make_policy("mars", COST, starvation="fcfs-wait"), small_profile())
    assert len(result.records) == 4
    assert sim.queue.fcfs_wait is not None and sim.queue.fcfs_wait._owed == {}


def _running_state(sim, rid, computed, blocks):
    """Set a running request's computed tokens and device blocks (allocated from the pool)."""
    sim_request = sim.live[rid]
    sim_request.progress.computed_tokens = computed
    sim.device.allocate(blocks - sim_request.device_blocks)
    sim_request.device_blocks = blocks
    return sim_request


def test_the_last_budget_token_goes_to_a_running_request_after_a_prefill_chunk():
    # C's 127-token chunk leaves one token of the budget: Y, decoding after it, still runs.
    policy = make_policy("vllm", COST)
    sim = _sim_with_running(policy, small_profile(), (single("C", 0.0, 127, 5), 0), (single("Y", 1.0, 20, 5), 0))
    _running_state(sim, "C", 0, 8)
    _running_state(sim, "Y", 19, 2)
    batch, settled = sim._build_batch()
    assert {r.rid: n for r, n in batch} == {"C": 127, "Y": 1}


def test_a_victim_taken_out_of_the_batch_gives_its_budget_back():
    # A (batched first, the latest arrival: FCFS's victim) is preempted when B needs a block; A's
    # token goes back to the budget, so C's prefill chunk still gets 127 of the 128.
    policy = make_policy("vllm", COST)
    sim = _sim_with_running(policy, small_profile(device_blocks=12), (single("A", 3.0, 20, 5), 0),
                            (single("B", 1.0, 33, 5), 0), (single("C", 2.0, 127, 5), 0))
    _running_state(sim, "A", 19, 2)
    _running_state(sim, "B", 32, 2)
    _running_state(sim, "C", 0, 8)
    assert sim.device.free == 0
    batch, settled = sim._build_batch()
    assert {r.rid: n for r, n in batch} == {"B": 1, "C": 127}
    assert not settled and sim.live["A"].preemptions == 1


def test_several_swap_ins_start_in_one_step():
    from marsched.sim.engine import Phase, SimRequest
    policy = make_policy("swap", COST)
    sim = _sim_with_running(policy, small_profile())
    for rid in ("s1", "s2"):
        progress = RequestProgress(two_segment(rid, 0.0, 20, 5, 1.0, 2, 5), order_s=0.0)
        policy.start_segment(progress, sim.load())
        sim_request = SimRequest(progress, phase=Phase.SWAPPED, host_blocks=2)
        sim.host.allocate(2)
        sim.live[rid] = sim_request
        sim.queue.push(progress, sim.load(), sim.iteration)
    assert sim._admit_from_queue({}, COST.token_budget)
    assert [sim.live[rid].phase for rid in ("s1", "s2")] == [Phase.SWAPPING_IN, Phase.SWAPPING_IN]


def test_a_step_that_admitted_a_request_before_a_stuck_swap_in_says_so():
    # "one" (a 1-token prompt) is admitted; the next head is swapped out and its swap-in does not
    # fit: the step must still report an admission, or it would count as settled (see below).
    from marsched.sim.engine import Phase, SimRequest
    policy = make_policy("swap", COST)
    sim = _sim_with_running(policy, small_profile(device_blocks=4))
    first = RequestProgress(single("one", 0.0, 1, 20), order_s=0.0)
    policy.start_segment(first, sim.load())
    sim.live["one"] = SimRequest(first)
    sim.queue.push(first, sim.load(), sim.iteration)
    swapped = RequestProgress(two_segment("s", 1.0, 200, 5, 1.0, 2, 5), order_s=1.0)
    policy.start_segment(swapped, sim.load())
    sim.live["s"] = SimRequest(swapped, phase=Phase.SWAPPED, host_blocks=7)
    sim.host.allocate(7)
    sim.queue.push(swapped, sim.load(), sim.iteration)
    batch = {}
    assert sim._admit_from_queue(batch, COST.token_budget) is True
    assert list(batch) == ["one"] and sim.live["s"].phase is Phase.SWAPPED


@pytest.mark.parametrize("policy_name, others", [
    ("vllm", []),  # the queue empties after it
    ("vllm", [single("big", 0.0, 60, 3)]),  # the next head does not fit in the blocks left
    ("mars", [single("big", 0.0, 40, 20)]),  # the next head is refused by MARS admission
])
def test_a_one_token_prompt_admitted_in_a_step_gets_its_first_token_after_one_iteration(policy_name, others):
    """A step that admitted a request is not a settled one: its prefill (here a single token, which
    looks like a decode) must not be run together with the decode iterations after it."""
    requests = [single("one", 0.0, 1, 20), *others]
    _, result, events = _run(requests, make_policy(policy_name, COST), small_profile(device_blocks=4))
    record = next(r for r in result.records if r.request_id == "one")
    first = next(e for e in events if e["event"] == "schedule")
    assert first["iterations"] == 1
    assert record.first_token_s == pytest.approx(first["span_s"])

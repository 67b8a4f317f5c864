"""`marsched audit`: clean simulator traces of every policy pass; each bug class, injected into
an engine or into a trace, is caught with a message a user understands.

vLLM traces are audited in `test_vllm_audit.py`.
"""

from __future__ import annotations

import json
from dataclasses import fields

import pytest

from marsched.audit import Check, TraceReadError, audit_trace
from marsched.metrics.trace import TraceFile, read_trace
from marsched.policy import POLICY_NAMES, StrategyAssignment, WaitingQueue, make_policy
from marsched.policy.policy import Order, Policy, StrategyRule
from marsched.policy.ranking import KeyForm
from marsched.sim.select import make_simulator
from simhelpers import COST, small_profile
from test_cli import marsched
from test_trace_consistency import _workload

# Tight memory: swaps, preemptions and, with a low threshold, promotions.
STRESS = dict(device_blocks=16, host_blocks=64)


def simulate(path, policy: Policy, queue: type[WaitingQueue] | None = None, **profile) -> list[dict]:
    trace = TraceFile(path)
    sim = make_simulator(_workload(), small_profile(**(profile or {"device_blocks": 20, "host_blocks": 64})), policy,
                    trace=trace)
    if queue is not None:
        sim.queue = sim.lifecycle.queue = queue(policy)
    sim.run()
    trace.close()
    return read_trace(path)


def audit_events(path, events: list[dict], policy: str | None = None):
    path.write_text("".join(json.dumps(e) + "\n" for e in events))
    return audit_trace(path, policy)


def stressed(tmp_path, **options) -> list[dict]:
    options = {"starvation": "iterations", "starvation_threshold": 5, "admission": "greedy", **options}
    if options["starvation"] == "off":
        del options["starvation_threshold"]
    return simulate(tmp_path / "clean.jsonl", make_policy("mars", COST, **options), **STRESS)


def only(result, check: Check, phrase: str) -> None:
    """Every violation is of `check`, and one says `phrase`."""
    assert result.violations, "the injected bug was not caught"
    assert {v.check for v in result.violations} == {check}, "\n".join(map(str, result.violations))
    assert any(phrase in str(v) for v in result.violations), "\n".join(map(str, result.violations))


def kinds(events):
    return {e["event"] for e in events}


# --- clean traces ---------------------------------------------------------------------


@pytest.mark.parametrize("policy_name", POLICY_NAMES)
def test_clean_simulator_traces_of_every_policy_pass(policy_name, tmp_path):
    for profile in ({"device_blocks": 20, "host_blocks": 64}, STRESS):
        simulate(tmp_path / "t.jsonl", make_policy(policy_name, COST), **profile)
        result = audit_trace(tmp_path / "t.jsonl", policy_name)
        assert result.clean, "\n".join(map(str, result.violations))
        assert result.requests == len(_workload())


@pytest.mark.parametrize("variant,threshold", [("iterations", 5), ("published", 5), ("age", 0.05),
                                               ("fcfs-wait:0.5", 0.05), ("off", None)])
def test_clean_traces_of_every_starvation_variant_pass(variant, threshold, tmp_path):
    options = {"starvation": variant} if threshold is None else {"starvation": variant, "starvation_threshold": threshold}
    events = stressed(tmp_path, **options)
    assert {"preempt", "swap_out", "swap_in"} <= kinds(events)
    assert ("promote" in kinds(events)) == (variant != "off")
    result = audit_trace(tmp_path / "clean.jsonl", "mars")
    assert result.clean, "\n".join(map(str, result.violations))


# --- the ranking order ----------------------------------------------------------------


def _subclass(policy: Policy, cls: type[Policy]) -> Policy:
    return cls(**{f.name: getattr(policy, f.name) for f in fields(Policy) if f.init})


class ByArrival(Policy):
    def queue_key_form(self, progress, load):  # the classic bug: MARS's queue left in arrival order
        if self.order is Order.MEMORY_TIME:
            return KeyForm(0.0, progress.order_s)
        return Policy.queue_key_form(self, progress, load)


class ByPromptSize(Policy):
    def queue_key_form(self, progress, load):
        return KeyForm(0.0, float(progress.request.prompt_tokens))


@pytest.mark.parametrize("bug", [ByArrival, ByPromptSize])
def test_a_queue_ranked_by_arrival_or_prompt_size_is_caught(bug, tmp_path):
    policy = _subclass(make_policy("mars", COST, starvation="off"), bug)
    simulate(tmp_path / "t.jsonl", policy, **STRESS)
    only(audit_trace(tmp_path / "t.jsonl", "mars"), Check.ORDER, "is not the memory-time key of its own predictions")


def test_a_better_ranked_request_left_waiting_is_caught(tmp_path):
    events = stressed(tmp_path, starvation="off")
    index = next(i for i, e in enumerate(events) if e["event"] == "admit" and not e["promoted"])
    schedule = next(e for e in events[index:] if e["event"] == "schedule")
    schedule["next_score"] = events[index]["score"] / 2
    only(audit_events(tmp_path / "t.jsonl", events), Check.ORDER, "the better (lower) score")


class PromotedLast(WaitingQueue):
    def pop(self, iteration, now_s):  # promoted requests only when nothing ranked is left
        entry = self._pop_heap() or self._pop_promoted()
        self._popped = entry
        if entry is None:
            return None
        self._leave(entry, iteration, now_s)
        entry.progress.left_key, entry.progress.left_promoted = entry.key, entry.promoted
        return entry.progress


def test_promoted_requests_not_going_first_is_caught(tmp_path):
    policy = make_policy("mars", COST, starvation="iterations", starvation_threshold=5, admission="greedy")
    simulate(tmp_path / "t.jsonl", policy, queue=PromotedLast, **STRESS)
    only(audit_trace(tmp_path / "t.jsonl"), Check.ORDER, "promoted requests go ahead of the score order")


def test_fcfs_keys_are_checked_against_arrival(tmp_path):
    events = simulate(tmp_path / "clean.jsonl", make_policy("infercept", COST))
    admit = next(e for e in events if e["event"] == "admit")
    admit["score"] += 1.0
    only(audit_events(tmp_path / "t.jsonl", events), Check.ORDER, "first come first served by arrival")


# --- strategies -----------------------------------------------------------------------


class DecidesAtTheCall(Policy):
    """MARS's rule as reproductions get it wrong: nothing ahead, the decision at the call (INFERCEPT's)."""

    def start_segment(self, progress, load):
        rule, self.rule = self.rule, StrategyRule.FIXED if self.fixed_strategy else StrategyRule.END_AT_CALL
        try:
            progress.predictions = [self.predictor.predict(progress.request, i)
                                    for i in range(len(progress.request.segments))]
            progress.strategy = None
        finally:
            self.rule = rule

    def strategy_at_call(self, progress, load):
        if progress.strategy is None:
            strategy = self._cheapest(progress.computed_tokens, progress.segment.api.duration_s, load)
            progress.assign(StrategyAssignment(progress.segment_index, strategy, load.now_s,
                                               progress.computed_tokens, progress.segment.api.duration_s, "ahead"))
        return progress.strategy


def test_a_strategy_chosen_at_the_call_is_caught(tmp_path):
    simulate(tmp_path / "t.jsonl", _subclass(make_policy("mars", COST, starvation="off"), DecidesAtTheCall))
    only(audit_trace(tmp_path / "t.jsonl"), Check.STRATEGY, "after the segment started running")


def _other(strategy: str) -> str:
    return "discard" if strategy != "discard" else "preserve"


def test_a_strategy_rechosen_on_preemption_is_caught(tmp_path):
    events = stressed(tmp_path, starvation="off")
    index = next(i for i, e in enumerate(events) if e["event"] == "preempt" and e["strategy"])
    preempt = events[index]
    events.insert(index + 1, {**preempt, "event": "assign_strategy", "strategy": _other(preempt["strategy"]),
                              "reason": "ahead", "context_tokens": 100, "api_s": 1.0})
    result = audit_events(tmp_path / "t.jsonl", events)
    only(result, Check.STRATEGY, "after a preemption")
    assert any("the call ran under" in str(v) for v in result.violations)


def test_a_strategy_changed_when_the_call_returns_is_caught(tmp_path):
    events = simulate(tmp_path / "clean.jsonl", make_policy("mars", COST))
    index = next(i for i, e in enumerate(events) if e["event"] == "api_end")
    start = next(e for e in reversed(events[:index]) if e["event"] == "api_start" and e["rid"] == events[index]["rid"])
    events.insert(index + 1, {**events[index], "event": "assign_strategy", "strategy": _other(start["strategy"]),
                              "reason": "ahead", "context_tokens": 100, "api_s": 1.0})
    only(audit_events(tmp_path / "t.jsonl", events), Check.STRATEGY, "after its call returned")


def test_a_call_run_under_another_strategy_is_caught(tmp_path):
    events = simulate(tmp_path / "clean.jsonl", make_policy("vllm", COST))
    start = next(e for e in events if e["event"] == "api_start" and e["strategy"])
    start["strategy"] = "preserve"
    only(audit_events(tmp_path / "t.jsonl", events), Check.STRATEGY, "the call ran under preserve")


def test_rules_are_those_of_the_policy_audited_as(tmp_path):
    simulate(tmp_path / "infercept.jsonl", make_policy("infercept", COST))
    result = audit_trace(tmp_path / "infercept.jsonl", "mars")
    assert {v.check for v in result.violations} == {Check.POLICY, Check.STRATEGY, Check.ORDER}
    assert any("reason 'at-call', but mars assigns ahead" in str(v) for v in result.violations)
    simulate(tmp_path / "mars.jsonl", make_policy("mars", COST))
    result = audit_trace(tmp_path / "mars.jsonl", "infercept")
    assert any("reason 'ahead', but infercept assigns at the call" in str(v) for v in result.violations)


# --- starvation -----------------------------------------------------------------------


class CounterNeverPromotes(WaitingQueue):
    def promote_starving(self, iteration, now_s):  # the counter is kept but never changes the order
        return []


def test_a_counter_that_never_promotes_is_caught(tmp_path):
    policy = make_policy("mars", COST, starvation="iterations", starvation_threshold=5, admission="greedy")
    simulate(tmp_path / "t.jsonl", policy, queue=CounterNeverPromotes, **STRESS)
    only(audit_trace(tmp_path / "t.jsonl"), Check.STARVATION, "not promoted: its counter is")


def test_a_misreported_counter_is_caught(tmp_path):
    events = stressed(tmp_path)
    admit = next(e for e in events if e["event"] == "admit" and e["counter"] > 0)
    admit["counter"] += 3
    only(audit_events(tmp_path / "t.jsonl", events), Check.STARVATION, "does not count waiting as declared")


def test_a_counter_carried_in_at_arrival_is_counted(tmp_path):
    # A later turn of a program over HTTP starts with its program's wait (`carried` on `arrive`),
    # and every stay of it counts from there (a threshold no stay reaches: no promotion resets it).
    events = stressed(tmp_path, starvation_threshold=100_000)
    rid = next(e["rid"] for e in events if e["event"] == "admit")
    for admit in (e for e in events if e["event"] == "admit" and e["rid"] == rid):
        admit["counter"] += 2
    only(audit_events(tmp_path / "t.jsonl", events), Check.STARVATION, "does not count waiting as declared")
    next(e for e in events if e["event"] == "arrive" and e["rid"] == rid)["carried"] = 2
    result = audit_events(tmp_path / "t.jsonl", events)
    assert result.clean, "\n".join(map(str, result.violations))


def test_a_promotion_before_the_threshold_is_caught(tmp_path):
    events = stressed(tmp_path, starvation_threshold=10)
    assert "promote" in kinds(events)
    events[0]["policy"]["starvation"]["threshold"] = 40  # the engine promoted at 10
    result = audit_events(tmp_path / "t.jsonl", events)
    assert any("promoted early" in str(v) and v.check is Check.STARVATION for v in result.violations)


def test_a_promotion_with_prevention_off_is_caught(tmp_path):
    events = stressed(tmp_path)
    events[0]["policy"]["starvation"]["threshold"] = None
    result = audit_events(tmp_path / "t.jsonl", events)
    assert any("starvation prevention is off" in str(v) for v in result.violations)


def _moving(tmp_path) -> list[dict]:
    events = stressed(tmp_path, starvation="fcfs-wait:0.5", starvation_threshold=0.1)
    promotes = [e for e in events if e["event"] == "promote"]
    assert promotes and any(e["threshold"] > 0.1 for e in promotes)  # the estimate moved the threshold
    return events


def test_a_moving_threshold_is_held_to_what_the_events_report(tmp_path):
    events = _moving(tmp_path)
    promote = next(e for e in events if e["event"] == "promote" and e["counter"] > 0.11)
    promote["threshold"] = promote["counter"] + 1.0  # the engine says it promoted below its threshold
    only(audit_events(tmp_path / "t.jsonl", events), Check.STARVATION, "promoted early")


def test_a_moving_threshold_missing_or_below_the_floor_is_caught(tmp_path):
    events = _moving(tmp_path)
    promote = next(e for e in events if e["event"] == "promote")
    del promote["threshold"]
    only(audit_events(tmp_path / "t.jsonl", events), Check.STARVATION, "does not report it")
    events = _moving(tmp_path)
    schedule = next(e for e in events if e["event"] == "schedule")
    schedule["threshold"] = 0.0
    only(audit_events(tmp_path / "t.jsonl", events), Check.STARVATION, "below the declared floor")


def test_a_request_past_the_moving_threshold_left_unpromoted_is_caught(tmp_path):
    events = _moving(tmp_path)
    for e in events:  # the engine reports a threshold lower than the one it promoted at
        if e["event"] in ("schedule", "promote"):
            e["threshold"] = 0.1
    result = audit_events(tmp_path / "t.jsonl", events)
    assert any("not promoted" in str(v) for v in result.violations), "\n".join(map(str, result.violations))


# --- requests and memory --------------------------------------------------------------


def test_a_lost_request_is_caught(tmp_path):
    events = simulate(tmp_path / "clean.jsonl", make_policy("mars", COST))
    events.remove(next(e for e in events if e["event"] == "finish" and e["rid"] == "s3"))
    only(audit_events(tmp_path / "t.jsonl", events), Check.LIFECYCLE, "request s3 at")
    assert "lost: arrived at" in str(audit_trace(tmp_path / "t.jsonl").violations[0])


def test_a_request_finished_twice_is_caught(tmp_path):
    events = simulate(tmp_path / "clean.jsonl", make_policy("mars", COST))
    index = next(i for i, e in enumerate(events) if e["event"] == "finish")
    events.insert(index + 1, dict(events[index]))
    only(audit_events(tmp_path / "t.jsonl", events), Check.LIFECYCLE, "finished twice")


def test_two_engines_writing_one_trace_are_caught_and_a_restart_is_not(tmp_path):
    """Data-parallel ranks given one trace path interleave their runs; a restarted engine appends
    its run after the last one's end."""
    first = simulate(tmp_path / "a.jsonl", make_policy("mars", COST))
    second = [{**e, "rid": f"b-{e['rid']}"} if "rid" in e else e
              for e in simulate(tmp_path / "b.jsonl", make_policy("mars", COST))]
    assert audit_events(tmp_path / "restart.jsonl", first + second).clean
    interleaved = [first[0], second[0], *first[1:], *second[1:]]
    only(audit_events(tmp_path / "mixed.jsonl", interleaved), Check.LIFECYCLE,
         "a run starts at line 2 while the run of line 1 has not ended: two engines wrote this trace")


def test_memory_over_capacity_and_held_at_the_end_are_caught(tmp_path):
    events = simulate(tmp_path / "clean.jsonl", make_policy("mars", COST))
    next(e for e in events if e["event"] == "schedule")["kv_device_blocks"] = 21
    events[-1]["kv_host_blocks"] = 3
    result = audit_events(tmp_path / "t.jsonl", events)
    only(result, Check.MEMORY, "21 device KV blocks in use after schedule, outside 0..20")
    assert any("3 host KV blocks still held when the run ended" in str(v) for v in result.violations)


# --- the command ----------------------------------------------------------------------


def test_exit_status_clean_violations_and_unreadable(tmp_path):
    events = simulate(tmp_path / "clean.jsonl", make_policy("mars", COST))
    run = marsched("audit", str(tmp_path / "clean.jsonl"), "--policy", "mars")
    assert run.returncode == 0 and "clean: no violations" in run.stdout, run.stderr
    events.insert(len(events) // 2, dict(next(e for e in events if e["event"] == "finish")))
    (tmp_path / "bad.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    run = marsched("audit", str(tmp_path / "bad.jsonl"))
    assert run.returncode == 1 and "[lifecycle]" in run.stdout and "finished twice" in run.stdout
    lines = (tmp_path / "clean.jsonl").read_text().splitlines()
    lines[6] = lines[6][:40]
    (tmp_path / "cut.jsonl").write_text("\n".join(lines) + "\n")
    run = marsched("audit", str(tmp_path / "cut.jsonl"))
    assert run.returncode == 2 and "line 7: not JSON" in run.stderr and "Traceback" not in run.stderr


@pytest.mark.parametrize("text,message", [
    ('{"event": "admit", "t": 0}\n', "line 1: admit event without"),
    ('{"event": "run", "t": 0, "iteration": 0}\n', "line 1: run event without"),
    ('[1, 2]\n', "line 1: an event must be a JSON object"),
    ('\n\n{"event": "teleport", "t": 0}\n', "line 3: unknown event 'teleport'"),
    ('', "no events"),
])
def test_unreadable_traces_name_the_line(text, message, tmp_path):
    (tmp_path / "t.jsonl").write_text(text)
    with pytest.raises(TraceReadError, match=message):
        audit_trace(tmp_path / "t.jsonl")


def test_infercept_codes_rule_allows_a_discard_or_swap_during_the_call_and_nothing_else(tmp_path):
    events = simulate(tmp_path / "clean.jsonl", make_policy("infercept-code", COST))
    assert audit_trace(tmp_path / "clean.jsonl").clean
    # Under pressure its passes admit out of arrival order (a request that fits passes one that does
    # not), which the trace does not explain: the order is not checked, and the trace is clean.
    simulate(tmp_path / "tight.jsonl", make_policy("infercept-code", COST), device_blocks=14, host_blocks=8)
    tight = audit_trace(tmp_path / "tight.jsonl")
    assert tight.clean and not tight.declared.order_checked
    index, changed = next((i, e) for i, e in enumerate(events)
                          if e["event"] == "assign_strategy" and e["reason"] == "reconsidered")
    back = [*events[:index + 1], {**changed, "strategy": "preserve"}, *events[index + 1:]]
    only(audit_events(tmp_path / "back.jsonl", back), Check.STRATEGY, f"from {changed['strategy']}")
    ret = next(i for i, e in enumerate(events) if e["event"] == "api_end")
    after = [*events[:ret + 1], {**events[ret], "event": "assign_strategy", "strategy": "discard",
                                 "reason": "reconsidered", "context_tokens": 10, "api_s": 0.0}, *events[ret + 1:]]
    only(audit_events(tmp_path / "after.jsonl", after), Check.STRATEGY, "after its call returned")


def _later_turns(admitted: list[str]) -> list[dict]:
    """A server's trace of two programs' later turns over HTTP, both promoted for life (`elder`): b's
    turn arrived first, a's program first (`program_arrival_s`); admitted together in `admitted` order."""
    run = {"event": "run", "t": 0.0, "iteration": 0, "schema_version": 1, "engine": "vllm", "device_blocks": 64,
           "host_blocks": 0, "block_tokens": 16, "kv_device_blocks": 0, "kv_host_blocks": 0,
           "policy": {"name": "mars", "order": "memory-time", "rule": "ahead", "fixed_strategy": None,
                      "starvation": {"variant": "custom", "threshold": 1e6, "clock": "seconds", "counts": "all-waiting",
                                     "protection": "segment", "quantum": 0, "for_life": True}}}
    arrived = {"b-2": (20.0, 5.0), "a-2": (30.0, 0.0)}  # (the turn's arrival, its program's)

    def event(kind, t, iteration, **fields):
        return {"event": kind, "t": t, "iteration": iteration, **fields, "kv_device_blocks": 0, "kv_host_blocks": 0}

    events = [run] + [event("arrive", at, 1, rid=rid, segment=0, queue="waiting", arrival_s=at, prompt_tokens=10,
                            program=rid[0], identity="stated", elder=True, program_arrival_s=first)
                      for rid, (at, first) in arrived.items()]
    events += [event("admit", 31.0, 2, rid=rid, segment=0, queue="running", prefill_tokens=10,
                     wait_s=31.0 - arrived[rid][0], score=1.0, promoted=True, counter=31.0 - arrived[rid][0],
                     protected_until=None, protected_segment=0) for rid in admitted]
    events.append(event("schedule", 31.0, 2, iterations=1, batch=2, tokens=20, context_tokens=20, free_blocks=64,
                        host_free_blocks=0, waiting=0, next_score=None, threshold=1e6))
    events += [event("finish", 32.0, 3, rid=rid, segment=0, queue="finished", e2e_s=32.0 - arrived[rid][0],
                     ttft_s=1.0, status="finished", strategies=[], preemptions=0, segments=1) for rid in admitted]
    return events + [event("end", 33.0, 3, requests=2)]


def test_later_turns_promoted_for_life_run_in_their_programs_arrival_order(tmp_path):
    # Over HTTP a program's later turn enters the promoted lane at once (`elder`), placed by its
    # program's first arrival (`program_arrival_s`), as the simulator's request keeps its arrival.
    result = audit_events(tmp_path / "t.jsonl", _later_turns(["a-2", "b-2"]))
    assert result.clean, "\n".join(map(str, result.violations))
    only(audit_events(tmp_path / "t.jsonl", _later_turns(["b-2", "a-2"])), Check.ORDER,
         "promoted requests are admitted by arrival (promoted for life), but a-2")
    unmarked = [{k: v for k, v in e.items() if k != "elder"} for e in _later_turns(["a-2", "b-2"])]
    said = [str(v) for v in audit_events(tmp_path / "t.jsonl", unmarked).violations]  # not known to be promoted
    assert any("admitted from the promoted lane (promoted=true) but never promoted" in v for v in said), said

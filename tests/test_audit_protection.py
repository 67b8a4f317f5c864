"""`marsched audit`'s protection check: no request protected by starvation prevention is preempted.

Hand-written traces pin each rule down (the quantum boundary to the iteration, protection for
life, segment protection, the requester's own yield, what an engine states); simulator runs
pass it, and a simulator that ignores protection is caught; in a vLLM run where every running
request is protected and memory binds, the requester gives up its own blocks.
"""

from __future__ import annotations

import json

import pytest

from marsched.audit import Check, audit_trace
from marsched.metrics.trace import QUEUE_AFTER, TraceFile
from marsched.policy import make_policy
from marsched.sim.engine import Simulator
from simhelpers import COST, small_profile
from test_audit import STRESS
from test_cli import marsched
from test_trace_consistency import _workload

THRESHOLD = 2  # iterations waited before a promotion


def run_event(protection: str = "quantum", quantum: int = 5, for_life: bool = False) -> dict:
    starvation = {"variant": "custom", "threshold": THRESHOLD, "clock": "iterations", "counts": "all-waiting",
                  "protection": protection, "quantum": quantum, "for_life": for_life}
    return {"event": "run", "t": 0.0, "iteration": 0, "kv_device_blocks": 0, "kv_host_blocks": 0,
            "schema_version": 1, "engine": "test", "device_blocks": 16, "host_blocks": 0, "block_tokens": 16,
            "policy": {"name": "mars", "order": "memory-time", "rule": "ahead", "fixed_strategy": None,
                       "starvation": starvation}}


class Events:
    """A trace written by hand: every event at `iteration` (t = iteration / 100 s), blocks as given."""

    def __init__(self, **declared) -> None:
        self.events = [run_event(**declared)]

    def add(self, kind: str, iteration: int, rid: str | None = None, segment: int = 0, blocks: int = 0,
            **fields) -> int:
        event = {"event": kind, "t": iteration / 100, "iteration": iteration, "kv_device_blocks": blocks,
                 "kv_host_blocks": 0}
        if rid is not None:
            if kind == "resume":
                queue = {"device": "running", "waiting": "waiting"}[fields["where"]]
            else:
                queue = fields.pop("queue", None) or QUEUE_AFTER[kind].value
            event.update(rid=rid, segment=segment, queue=queue)
        event.update(fields)
        self.events.append(event)
        return len(self.events)  # its line number

    def arrive(self, iteration: int, rid: str, segments: int = 1) -> None:
        self.add("arrive", iteration, rid, arrival_s=iteration / 100, prompt_tokens=16, segments=segments)
        if segments > 1:
            self.add("assign_strategy", iteration, rid, queue="waiting", strategy="discard", reason="ahead")

    def admit(self, iteration: int, rid: str, counter: float, promoted: bool = False, segment: int = 0,
              **fields) -> int:
        return self.add("admit", iteration, rid, segment, score=1.0, promoted=promoted, counter=counter, **fields)

    def preempt(self, iteration: int, rid: str, segment: int = 0, strategy: str | None = None, **fields) -> int:
        return self.add("preempt", iteration, rid, segment, strategy=strategy, **fields)

    def write(self, path, end: int = 50) -> None:
        self.add("end", end, requests=len({e["rid"] for e in self.events if e["event"] == "arrive"}))
        path.write_text("".join(json.dumps(e) + "\n" for e in self.events))


def protection(result) -> list:
    return [v for v in result.violations if v.check is Check.PROTECTION]


def quantum_trace(preempt_at: int, quantum: int = 5) -> tuple[Events, int, int]:
    """B runs unprotected; A, promoted, is admitted at iteration 2 and preempted at `preempt_at`."""
    t = Events(quantum=quantum)
    t.arrive(0, "B")
    t.arrive(0, "A")
    t.admit(0, "B", counter=0)
    t.add("promote", 2, "A", counter=2)
    admit = t.admit(2, "A", counter=0, promoted=True)  # the counter restarts at the promotion
    preempt = t.preempt(preempt_at, "A")
    t.admit(preempt_at + 1, "A", counter=1)
    t.add("finish", 40, "A")
    t.add("finish", 41, "B")
    return t, admit, preempt


@pytest.mark.parametrize("quantum", [5, 1, 30])
def test_the_quantum_ends_exactly_quantum_iterations_after_the_admission(quantum, tmp_path):
    # Admitted at iteration 2: protected at 2 .. 2 + quantum - 1, preemptible from 2 + quantum.
    events, admit, preempt = quantum_trace(2 + quantum - 1, quantum)
    events.write(tmp_path / "inside.jsonl")
    result = audit_trace(tmp_path / "inside.jsonl")
    found = protection(result)
    assert [v.rid for v in found] == ["A"], "\n".join(map(str, result.violations))
    assert found[0].lines == (admit, preempt)
    assert found[0].t == pytest.approx((2 + quantum - 1) / 100)
    assert f"until iteration {2 + quantum}" in found[0].message and "unprotected B" in found[0].message
    assert len(result.violations) == 1, "\n".join(map(str, result.violations))

    events, _, _ = quantum_trace(2 + quantum, quantum)
    events.write(tmp_path / "after.jsonl")
    result = audit_trace(tmp_path / "after.jsonl")
    assert result.clean, "\n".join(map(str, result.violations))


def test_a_quantum_of_zero_protects_nothing(tmp_path):
    events, _, _ = quantum_trace(2, quantum=0)
    events.write(tmp_path / "t.jsonl")
    assert audit_trace(tmp_path / "t.jsonl").clean


def for_life_trace(for_life: bool) -> tuple[Events, int, int]:
    """A promoted at 2 (quantum 5, until 7), preempted at 8 (allowed), admitted again at 9 and
    preempted at 11: protected again only if its promotion is for life."""
    t = Events(quantum=5, for_life=for_life)
    t.arrive(0, "B")
    t.arrive(0, "A")
    t.admit(0, "B", counter=0)
    t.add("promote", 2, "A", counter=2)
    # For life the counter does not restart at the promotion, and A rejoins the promoted lane.
    carried = 2 if for_life else 0
    t.admit(2, "A", counter=carried, promoted=True)
    t.preempt(8, "A")
    again = t.admit(9, "A", counter=carried + 1, promoted=for_life)
    preempt = t.preempt(11, "A")
    t.admit(11, "A", counter=carried + 1, promoted=for_life)  # back at once: its counter as it left
    t.add("finish", 40, "A")
    t.add("finish", 41, "B")
    return t, again, preempt


def test_a_promotion_for_life_protects_every_admission(tmp_path):
    events, again, preempt = for_life_trace(for_life=True)
    events.write(tmp_path / "life.jsonl")
    result = audit_trace(tmp_path / "life.jsonl")
    found = protection(result)
    assert [(v.rid, v.lines) for v in found] == [("A", (again, preempt))], "\n".join(map(str, result.violations))
    assert "until iteration 14" in found[0].message
    assert len(result.violations) == 1, "\n".join(map(str, result.violations))

    events, _, _ = for_life_trace(for_life=False)
    events.write(tmp_path / "once.jsonl")
    result = audit_trace(tmp_path / "once.jsonl")
    assert result.clean, "\n".join(map(str, result.violations))


def segment_trace(protection_mode: str, preempt_segment: int) -> tuple[Events, int, int]:
    """A promoted and admitted at 2 in segment 0; preempted at 10 in segment 0, or after its call
    (discarded, back at 6, admitted at 7) in segment 1. Quantum 100."""
    t = Events(protection=protection_mode, quantum=100)
    t.arrive(0, "B")
    t.arrive(0, "A", segments=2)
    t.admit(0, "B", counter=0)
    t.add("promote", 2, "A", counter=2)
    admit = t.admit(2, "A", counter=0, promoted=True)
    if preempt_segment == 1:
        t.add("api_start", 4, "A", strategy="discard", context_tokens=20, duration_s=0.02)
        t.add("api_end", 6, "A", return_tokens=2)
        t.add("resume", 6, "A", segment=1, where="waiting")
        t.admit(7, "A", counter=1, segment=1)
    preempt = t.preempt(10, "A", segment=preempt_segment, strategy=None if preempt_segment else "discard")
    t.admit(10, "A", counter=1 if preempt_segment else 0, segment=preempt_segment)
    t.add("finish", 40, "A", segment=preempt_segment)
    t.add("finish", 41, "B")
    return t, admit, preempt


def test_segment_protection_lasts_the_segment_and_a_quantum_outlasts_the_call(tmp_path):
    cases = {("segment", 0): True, ("segment", 1): False, ("quantum", 1): True, ("quantum", 0): True}
    for (mode, segment), violates in cases.items():
        events, admit, preempt = segment_trace(mode, segment)
        path = tmp_path / f"{mode}-{segment}.jsonl"
        events.write(path)
        result = audit_trace(path)
        others = [v for v in result.violations if v.check is not Check.PROTECTION]
        assert not others, "\n".join(map(str, others))
        found = protection(result)
        assert [v.lines for v in found] == ([(admit, preempt)] if violates else []), (mode, segment, found)
        if violates and mode == "segment":
            assert "protected in segment 0" in found[0].message


def crowded_trace(**preempt_fields) -> tuple[Events, int]:
    """A and C, both promoted and protected, run alone; memory binds and A is preempted."""
    t = Events(quantum=50)
    t.arrive(0, "A")
    t.arrive(0, "C")
    t.add("promote", 2, "A", counter=2)
    t.add("promote", 2, "C", counter=2)
    t.admit(2, "A", counter=0, promoted=True)
    t.admit(2, "C", counter=0, promoted=True)
    preempt = t.preempt(5, "A", **preempt_fields)
    t.admit(6, "A", counter=1)
    t.add("finish", 40, "A")
    t.add("finish", 41, "C")
    return t, preempt


def test_unprotected_victims_and_the_requesters_own_yield_are_fine(tmp_path):
    # B never promoted: preempting it beside a protected A is what the policy does.
    t = Events(quantum=50)
    t.arrive(0, "B")
    t.arrive(0, "A")
    t.admit(0, "B", counter=0)
    t.add("promote", 2, "A", counter=2)
    t.admit(2, "A", counter=0, promoted=True)
    t.preempt(5, "B")
    t.admit(6, "B", counter=1)
    t.add("finish", 40, "A")
    t.add("finish", 41, "B")
    t.write(tmp_path / "unprotected.jsonl")
    assert audit_trace(tmp_path / "unprotected.jsonl").clean

    # Everything running is protected: the request that needs the blocks gives up its own.
    events, _ = crowded_trace(requester="A")
    events.write(tmp_path / "yield.jsonl")
    result = audit_trace(tmp_path / "yield.jsonl")
    assert result.clean and not result.notes, "\n".join(map(str, result.violations))


def test_evicting_another_protected_request_is_caught_when_the_requester_is_named(tmp_path):
    events, preempt = crowded_trace(requester="C")
    events.write(tmp_path / "evict.jsonl")
    result = audit_trace(tmp_path / "evict.jsonl")
    found = protection(result)
    assert [(v.rid, v.lines[-1]) for v in found] == [("A", preempt)], "\n".join(map(str, result.violations))
    assert "for C" in found[0].message
    assert len(result.violations) == 1

    # Without `requester` the audit cannot tell a yield from an eviction: it says so, and passes.
    events, _ = crowded_trace()
    events.write(tmp_path / "unnamed.jsonl")
    result = audit_trace(tmp_path / "unnamed.jsonl")
    assert result.clean
    assert len(result.notes) == 1 and "1 protected request(s)" in result.notes[0]
    run = marsched("audit", str(tmp_path / "unnamed.jsonl"))
    assert run.returncode == 0, run.stdout + run.stderr
    assert "preempt.requester" in run.stdout and "clean: no violations" in run.stdout


def test_an_engines_stated_protection_is_checked_and_then_followed(tmp_path):
    # Stated as the declared rule gives: clean.
    events, admit, _ = quantum_trace(7)
    events.events[admit - 1]["protected_until"] = 7
    events.write(tmp_path / "agrees.jsonl")
    assert audit_trace(tmp_path / "agrees.jsonl").clean

    # An off-by-one engine: the admit says so, and the preemption at 7 follows its statement.
    events, admit, preempt = quantum_trace(7)
    events.events[admit - 1]["protected_until"] = 8
    events.write(tmp_path / "longer.jsonl")
    found = protection(audit_trace(tmp_path / "longer.jsonl"))
    assert [v.lines for v in found] == [(admit,), (admit, preempt)], "\n".join(map(str, found))
    assert "protected_until=8" in found[0].message and "gives 7" in found[0].message

    # A resume may renew protection (the vLLM plugin protects an elder back from a preserved call).
    t = Events(quantum=5)
    t.arrive(0, "B")
    t.arrive(0, "A", segments=2)
    t.admit(0, "B", counter=0)
    t.add("promote", 2, "A", counter=2)
    t.admit(2, "A", counter=0, promoted=True)
    t.add("api_start", 3, "A", strategy="discard", context_tokens=20, duration_s=0.02)
    t.add("api_end", 5, "A", return_tokens=2)
    renewal = t.add("resume", 5, "A", segment=1, where="waiting", protected_until=20)
    t.admit(6, "A", counter=1, segment=1)
    preempt = t.preempt(12, "A", segment=1)
    t.admit(12, "A", counter=1, segment=1)
    t.add("finish", 40, "A", segment=1)
    t.add("finish", 41, "B")
    t.write(tmp_path / "renewed.jsonl")
    found = protection(audit_trace(tmp_path / "renewed.jsonl"))
    assert [v.lines for v in found] == [(renewal, preempt)], "\n".join(map(str, found))


# --- simulator runs -------------------------------------------------------------------------


class IgnoresProtection(Simulator):
    """A victim rule that forgets starvation protection: the lowest-ranked running request."""

    def _victim(self, requester):
        load = self.load()
        return max((r for r in self.running if r.phase.value == "running"),
                   key=lambda r: self.policy.victim_key(r.progress, load))


def simulate(path, engine: type[Simulator], variant: str, threshold: float, **profile):
    trace = TraceFile(path)
    policy = make_policy("mars", COST, starvation=variant, starvation_threshold=threshold, admission="greedy")
    engine(_workload(), small_profile(**profile), policy, trace=trace).run()
    trace.close()
    return audit_trace(path)


VARIANTS = [("iterations", 5), ("published", 2), ("age", 0.05), ("fcfs-wait:0.5", 0.05)]
TIGHT = dict(device_blocks=12, host_blocks=16)


@pytest.mark.parametrize("variant,threshold", VARIANTS)
def test_simulator_runs_pass_with_every_preemption_attributed(variant, threshold, tmp_path):
    for profile in (STRESS, TIGHT):
        path = tmp_path / "t.jsonl"
        result = simulate(path, Simulator, variant, threshold, **profile)
        assert result.clean, "\n".join(map(str, result.violations))
        assert not result.notes  # every preempt names its requester
        events = [json.loads(line) for line in path.read_text().splitlines()]
        assert any(e["event"] == "preempt" for e in events) and any(e["event"] == "promote" for e in events)
        assert any(e["event"] == "admit" and e["protected_until" if variant in ("iterations", "published")
                                              else "protected_segment"] is not None for e in events)


def test_a_simulator_that_ignores_protection_is_caught(tmp_path):
    caught = 0
    for variant, threshold in VARIANTS:
        for profile in (STRESS, TIGHT):
            result = simulate(tmp_path / "t.jsonl", IgnoresProtection, variant, threshold, **profile)
            found = protection(result)
            caught += len(found)
            assert all("while protected" in v.message for v in found)
    assert caught >= 4


def test_the_audit_command_passes_a_simulated_run(tmp_path):
    trace = tmp_path / "run.jsonl"
    run = marsched("simulate", "--policy", "mars", "--trace", "single", "--qps", "8", "--duration", "20",
                   "--starvation", "iterations", "--starvation-threshold", "20", "--trace-out", str(trace))
    assert run.returncode == 0, run.stderr
    run = marsched("audit", str(trace))
    assert run.returncode == 0, run.stdout + run.stderr
    assert "clean: no violations" in run.stdout


# --- vLLM ---------------------------------------------------------------------------------


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_vllm_when_every_running_request_is_protected_the_requester_gives_up_its_blocks(tiny_model, tmp_path):
    # Three requests promoted at the first step (threshold 1 iteration) and admitted together, each
    # protected for the quantum of 100,000 iterations; greedy admission lets their growth outrun
    # the 7 usable blocks, so vLLM must preempt a protected request. Before the shared victim rule
    # (`marsched.lifecycle.choose_victim`) the plugin's running order made vLLM take running[-1],
    # the lowest-ranked protected request, for a better-ranked requester.
    pytest.importorskip("vllm")
    from vllm import LLM, SamplingParams

    from marsched.vllm.metadata import ChunkMeta, PlannedSegment
    from test_vllm_audit import ended_trace

    trace = tmp_path / "protected.jsonl"
    config = {"marsched": {"policy": "mars", "starvation": "iterations", "starvation_threshold": 1,
                           "admission": "greedy", "trace_path": str(trace)}}
    llm = LLM(model=tiny_model, dtype="float32", enforce_eager=True, block_size=32, max_model_len=160,
              num_gpu_blocks_override=8, enable_prefix_caching=False, seed=0,
              scheduler_cls="marsched.vllm.MarsScheduler", additional_config=config)
    try:
        prompts, params = [], []
        for index in range(3):
            meta = ChunkMeta(0, (PlannedSegment(60),), request_id=f"protected-{index}")
            prompts.append({"prompt_token_ids": [(11 * index + j) % 500 + 4 for j in range(40)]})
            params.append(SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True,
                                         extra_args=meta.to_extra_args()))
        llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.llm_engine.engine_core.shutdown()
    events = ended_trace(trace)
    promoted = {e["rid"] for e in events if e["event"] == "admit" and e["promoted"]}
    crowded = [e for e in events if e["event"] == "preempt" and e["rid"] in promoted]
    if not crowded or not all("requester" in e for e in crowded):
        pytest.fail(f"not provoked: preemptions of promoted requests {crowded}")
    assert all(e["requester"] == e["rid"] for e in crowded), crowded
    result = audit_trace(trace)
    assert result.clean and not result.notes, "\n".join(map(str, result.violations))

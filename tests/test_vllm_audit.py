"""Real vLLM traces follow the trace schema and pass the audit.

The audit's rules are about the trace, and the simulator's traces of every policy pass them
(test_audit.py). What only a real engine shows is MarsScheduler's trace, written from vLLM's
own requests, blocks and clock, under each way vLLM runs a call: one AugmentedEngine (CPU,
tiny random model) per strategy rule serves the same augmented requests (two calls each) and
plain ones at once (`vllm_scenarios.mixed_requests`):

- `vllm`: end at the call (the request leaves vLLM and queues again at the tail);
- `infercept`: decided at the call, reconsidered while paused;
- `discard`: one fixed strategy (its engine, once idle, also takes the SIGTERM test);
- `mars`: ahead of the segment, ranked by memory x time: test_vllm_runtime.py's engine, whose
  whole trace (Preserve, Discard and Swap side by side, faults, aborts) is audited at its end.

`sjf`, `preserve` and `swap` are those rules with another ranking key or fixed strategy: their
keys and rules are the policy core's (audited in the simulator); Preserve and Swap on vLLM's
KV cache are test_vllm_runtime.py's. The three engines (engines.AUDITED) start with the session
and serve side by side. Each trace is read after shutdown, when the scheduler has written its
`end` event.
"""

from __future__ import annotations

import ctypes
import os
import signal
import time

import pytest

pytest.importorskip("vllm")

from engines import AUDIT_POLICIES, AUDITED  # noqa: E402
from marsched.audit import audit_trace  # noqa: E402
from marsched.policy.registry import SIMULATOR_ONLY  # noqa: E402
from marsched.vllm import AugmentedEngine  # noqa: E402
from test_trace_schema import schema_errors  # noqa: E402
from vllm_scenarios import REQUESTS, assert_audited, ended_trace, mixed_requests  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def runs(audit_vllm_engine, audit_infercept_engine, audit_discard_engine):
    """Each policy's engine (engines.AUDITED) once it has served the stream, all side by side:
    {policy: (engines.SharedEngine, results or the exception its tests raise)}."""
    shared = dict(zip(AUDIT_POLICIES, (audit_vllm_engine, audit_infercept_engine, audit_discard_engine)))
    assert {policy: s.config for policy, s in shared.items()} == AUDITED
    serving = {policy: s.loop.submit(mixed_requests(s.engine, policy)) for policy, s in shared.items()}
    runs = {}
    for policy, future in serving.items():
        try:
            runs[policy] = shared[policy], future.result(300)
        except Exception as error:  # noqa: BLE001 - raised by the policy's own tests
            runs[policy] = shared[policy], error
    return runs


def served(runs, policy: str):
    shared, results = runs[policy]
    if isinstance(results, Exception):
        raise results
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]
    return shared


def test_the_engine_refuses_a_simulator_only_policy_before_starting(tiny_model):
    for policy in SIMULATOR_ONLY:
        with pytest.raises(ValueError, match="runs only in the simulator"):
            AugmentedEngine(tiny_model, policy=policy)


def test_an_idle_engine_core_shuts_down_on_a_sigterm_taken_by_another_thread(runs):
    # The kernel may hand vLLM's process-directed SIGTERM to any engine-core thread, but Python runs
    # the handler in the main thread, which an idle engine leaves asleep on its input queue (see
    # marsched/vllm/signals.py). Aim the signal at another thread on purpose.
    tgkill = getattr(ctypes.CDLL(None, use_errno=True), "tgkill", None)
    if tgkill is None:
        pytest.skip("no tgkill in this libc")
    run = served(runs, "discard")
    try:
        process = run.engine.llm.engine_core.resources.engine_manager.processes[0]
        time.sleep(1)  # the engine core goes idle

        def takes_sigterm(tid: int) -> bool:  # ZMQ's threads block every signal
            try:
                with open(f"/proc/{process.pid}/task/{tid}/status") as status:
                    blocked = next(int(line.split()[1], 16) for line in status if line.startswith("SigBlk:"))
            except FileNotFoundError:  # gone since
                return False
            return not blocked & (1 << (signal.SIGTERM - 1))

        threads = [t for t in sorted(map(int, os.listdir(f"/proc/{process.pid}/task")))
                   if t != process.pid and takes_sigterm(t)]
        # Some threads come and go: the first one still there takes it.
        assert any(tgkill(process.pid, tid, signal.SIGTERM) == 0 for tid in threads), "no thread to signal"
        # Before shutdown() (its own SIGTERM may wake the main thread): the scheduler has ended the trace.
        assert ended_trace(run.trace_file, timeout_s=30)[-1]["event"] == "end", "the engine core did not act on SIGTERM"
    finally:
        run.shutdown()


@pytest.mark.parametrize("policy", AUDIT_POLICIES)
def test_vllm_trace_follows_the_schema_and_passes_the_audit(policy, runs):
    run = served(runs, policy)
    run.shutdown()  # discard's may have ended on the SIGTERM above: its trace is audited all the same
    assert_audited(run.trace_file, policy, REQUESTS)


def test_vllm_starvation_counter_and_promotions_pass_the_audit(tiny_model, tmp_path):
    # test_vllm_order's constrained cache (one request at a time, the rest queue) under MARS with
    # the `iterations` variant declared from the start: the longest requests are promoted at 10.
    from vllm import LLM, SamplingParams

    from marsched.vllm.metadata import ChunkMeta, PlannedSegment

    trace = tmp_path / "starvation.jsonl"
    config = {"marsched": {"policy": "mars", "starvation": "iterations", "starvation_threshold": 10,
                           "trace_path": str(trace)}}
    llm = LLM(model=tiny_model, dtype="float32", enforce_eager=True, block_size=32, max_model_len=160,
              num_gpu_blocks_override=6, enable_prefix_caching=False, seed=0,
              scheduler_cls="marsched.vllm.MarsScheduler", additional_config=config)
    try:
        prompts, params = [], []
        for index, predicted in enumerate([80, 50, 20, 5]):
            meta = ChunkMeta(0, (PlannedSegment(predicted),), request_id=f"starve-{predicted}")
            prompts.append({"prompt_token_ids": [(7 * index + j) % 500 + 4 for j in range(100)]})
            params.append(SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True,
                                         extra_args=meta.to_extra_args()))
        llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.llm_engine.engine_core.shutdown()
    events = ended_trace(trace)
    assert [e["rid"] for e in events if e["event"] == "promote"] == ["starve-80", "starve-50", "starve-20"]
    assert schema_errors(events) == []
    result = audit_trace(trace, "mars")
    assert result.violations == [], "\n".join(map(str, result.violations))

"""Real vLLM traces of every policy follow the trace schema and pass the audit.

One AugmentedEngine per policy (CPU, tiny random model) serves a few augmented requests
(two calls each) and plain ones at once; the trace is read after shutdown, when the
scheduler has written its `end` event.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import signal
import time

import pytest

pytest.importorskip("vllm")

from marsched.audit import audit_trace  # noqa: E402
from marsched.metrics.trace import read_trace  # noqa: E402
from marsched.policy import POLICY_NAMES  # noqa: E402
from marsched.policy.registry import SIMULATOR_ONLY  # noqa: E402
from marsched.vllm import AugmentedEngine, Step, ToolCall  # noqa: E402
from test_trace_schema import schema_errors  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]


def steps(index: int) -> list[Step]:
    call = ToolCall("sleep", {"duration_s": 0.05 + 0.05 * index, "tokens": [100 + index] * 4})
    return [Step(12 + index, call), Step(8, call), Step(6)]


def ended_trace(path, timeout_s: float = 60.0) -> list[dict]:
    """The trace once the engine-core process has shut down its scheduler (it writes `end` then;
    `shutdown()` returns before the process is done)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            events = read_trace(path)
        except ValueError:  # a line being written
            events = [{"event": None}]
        if events[-1]["event"] == "end" or time.monotonic() > deadline:
            return events
        time.sleep(0.2)


def test_the_engine_refuses_a_simulator_only_policy_before_starting(tiny_model):
    for policy in SIMULATOR_ONLY:
        with pytest.raises(ValueError, match="runs only in the simulator"):
            AugmentedEngine(tiny_model, policy=policy)


@pytest.mark.parametrize("policy", [p for p in POLICY_NAMES if p not in SIMULATOR_ONLY])
def test_vllm_trace_follows_the_schema_and_passes_the_audit(policy, tiny_model, loop_thread, tmp_path):
    trace = tmp_path / f"{policy}.jsonl"

    async def scenario():
        engine = AugmentedEngine(tiny_model, policy=policy, trace_path=str(trace), dtype="float32",
                                 enforce_eager=True, block_size=32, max_model_len=512, seed=0)
        await engine.start()
        try:
            augmented = [engine.generate(list(range(10 + i, 40 + i)), steps(i), request_id=f"aug-{i}",
                                         ignore_eos=True) for i in range(4)]
            plain = [engine.generate(list(range(50 + i, 70 + i)), [Step(10)], request_id=f"plain-{i}",
                                     ignore_eos=True) for i in range(2)]
            return await asyncio.gather(*augmented, *plain)
        finally:
            engine.shutdown()

    results = loop_thread.run(scenario(), timeout=300)
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]
    events = ended_trace(trace)
    assert events[0]["event"] == "run" and events[0]["engine"] == "vllm" and events[-1]["event"] == "end"
    assert schema_errors(events) == []
    result = audit_trace(trace, policy)
    assert result.requests == 6
    assert result.violations == [], "\n".join(map(str, result.violations))


def test_an_idle_engine_core_shuts_down_on_a_sigterm_taken_by_another_thread(tiny_model, loop_thread, tmp_path):
    # The kernel may hand vLLM's process-directed SIGTERM to any engine-core thread, but Python runs
    # the handler in the main thread, which an idle engine leaves asleep on its input queue (see
    # marsched/vllm/signals.py). Aim the signal at another thread on purpose.
    tgkill = getattr(ctypes.CDLL(None, use_errno=True), "tgkill", None)
    if tgkill is None:
        pytest.skip("no tgkill in this libc")
    trace = tmp_path / "sigterm.jsonl"

    async def serve_one():
        engine = AugmentedEngine(tiny_model, policy="discard", trace_path=str(trace), dtype="float32",
                                 enforce_eager=True, block_size=32, max_model_len=512, seed=0)
        await engine.start()
        return engine, await engine.generate(list(range(10, 40)), [Step(8)], ignore_eos=True)

    async def shutdown(engine):
        engine.shutdown()

    engine, result = loop_thread.run(serve_one(), timeout=300)
    try:
        assert result.ok, result.error
        process = engine.llm.engine_core.resources.engine_manager.processes[0]
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
        assert ended_trace(trace, timeout_s=30)[-1]["event"] == "end", "the engine core did not act on SIGTERM"
    finally:
        loop_thread.run(shutdown(engine), timeout=60)


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

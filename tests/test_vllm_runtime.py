"""Augmented requests on real vLLM (CPU, tiny random model): KV correctness, memory, faults, trace.

One AsyncLLM engine (MarsScheduler + HostSwapConnector; `engines.RUNTIME`) serves the module; each
request picks its strategy with a per-request override, so Preserve, Discard and
Swap run side by side in the same batch. The last test serves the audit's requests
under MARS's own strategies, stops the engine and audits their part of the trace as
MARS (test_vllm_audit.py's real-engine audit, for MARS's rule).
"""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("vllm")

from marsched.metrics.trace import read_trace  # noqa: E402
from marsched.vllm import Step, ToolCall  # noqa: E402
from test_trace_schema import schema_errors  # noqa: E402
from vllm_scenarios import REQUESTS, assert_audited, ended_trace, mixed_requests  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

P0 = list(range(10, 41))
RET_A = [100, 101, 102, 103, 104]
RET_B = [200 + i for i in range(9)]
OTHERS = [[50 + i, 60 + i, 70 + i, 80 + i] * 5 for i in range(3)]


def three_segments(duration_s: float = 0.3) -> list[Step]:
    return [Step(24, ToolCall("sleep", {"duration_s": duration_s, "tokens": RET_A})),
            Step(20, ToolCall("sleep", {"duration_s": duration_s, "tokens": RET_B})),
            Step(16)]


@pytest.fixture(scope="module")
def engine(runtime_engine):
    return runtime_engine.engine


@pytest.fixture(scope="module")
def loop_thread(runtime_engine):
    """The engine's own loop (engines.SharedEngine)."""
    return runtime_engine.loop


def run(loop_thread, coro, timeout=120):
    return loop_thread.run(coro, timeout)


async def wait_state(engine, predicate, timeout=10.0):
    state = await engine.state()
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate(state):
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"engine state never matched: {state}")
        await asyncio.sleep(0.05)
        state = await engine.state()
    return state


def idle(state) -> bool:
    s = state.get("scheduler") or {}
    return (s.get("tracked") == 0 and s.get("device_free_blocks") == s.get("device_total_blocks")
            and state["host_bytes"] == 0 and s.get("host_tokens") == 0)


def test_token_identity_preserve_discard_swap(engine, loop_thread):
    async def scenario():
        augmented = [engine.generate(P0, three_segments(), strategy=s, request_id=f"id-{s}", ignore_eos=True)
                     for s in ("preserve", "discard", "swap")]
        plain = [engine.generate(p, [Step(80)], request_id=f"plain-{i}", ignore_eos=True)
                 for i, p in enumerate(OTHERS)]
        results = await asyncio.gather(*augmented, *plain)
        # References: uninterrupted requests over the same full token sequence.
        aug = results[0]
        refs = []
        context = list(P0)
        for index, segment in enumerate(aug.segments):
            ref = await engine.generate(context, [Step(len(segment.token_ids))], ignore_eos=True)
            refs.append(ref.output_token_ids)
            context = context + segment.token_ids + segment.returned_token_ids
        alone = [await engine.generate(p, [Step(80)], ignore_eos=True) for p in OTHERS]
        return results, refs, alone

    results, refs, alone = run(loop_thread, scenario())
    augmented, plain = results[:3], results[3:]
    for result in results:
        assert result.ok, result.error
    for result in augmented:
        assert [len(s.token_ids) for s in result.segments] == [24, 20, 16]
        assert [s.token_ids for s in result.segments] == refs, result.request_id
        assert result.token_ids == augmented[0].token_ids
    assert [r.output_token_ids for r in plain] == [r.output_token_ids for r in alone]

    # Each call ran under its strategy, and the decisions came back with the result.
    for result, strategy in zip(augmented, ("preserve", "discard", "swap")):
        assert [s.strategy for s in result.segments[:2]] == [strategy, strategy]
        assert all(s.strategy_assigned_s is not None and s.predicted_output_tokens for s in result.segments[:2])
        assert result.segments[0].predicted_output_tokens == 24
    events = read_trace(engine.trace_file)
    swap_events = [e for e in events if e.get("rid") == "id-swap"]
    assert [e["blocks"] > 0 for e in swap_events if e["event"] in ("swap_out", "swap_in")] == [True] * 4
    discard_admits = [e for e in events if e.get("rid") == "id-discard" and e["event"] == "admit"]
    assert [e["prefill_tokens"] for e in discard_admits[1:]] == [24 + 5 + 31, 24 + 5 + 20 + 9 + 31]  # full recompute
    kinds = {e["event"] for e in events}
    assert {"arrive", "assign_strategy", "admit", "api_start", "swap_out", "swap_in", "api_end", "resume",
            "finish"} <= kinds
    run(loop_thread, wait_state(engine, idle))


@pytest.mark.parametrize("strategy", ["preserve", "discard", "swap"])
def test_memory_during_a_call(engine, loop_thread, strategy):
    async def scenario():
        started, release = asyncio.Event(), asyncio.Event()

        async def hold(args):
            started.set()
            await release.wait()
            return RET_A

        engine.tools.register("hold", hold, timeout_s=60)
        before = await wait_state(engine, idle)
        task = asyncio.ensure_future(engine.generate(
            P0, [Step(40, ToolCall("hold")), Step(8)], strategy=strategy, request_id=f"mem-{strategy}",
            ignore_eos=True))
        await started.wait()
        if strategy == "preserve":
            during = await wait_state(engine, lambda s: s["scheduler"]["paused"] == 1)
        elif strategy == "discard":
            during = await wait_state(engine, lambda s: s["scheduler"]["paused"] == 1
                                      and s["scheduler"]["device_free_blocks"] == s["scheduler"]["device_total_blocks"])
        else:
            during = await wait_state(engine, lambda s: s["host_bytes"] > 0)
        release.set()
        result = await task
        after = await wait_state(engine, idle)
        return before, during, result, after

    before, during, result, after = run(loop_thread, scenario())
    assert result.ok, result.error
    sched = during["scheduler"]
    total = sched["device_total_blocks"]
    held = total - sched["device_free_blocks"]
    if strategy == "preserve":
        assert held == 3 and sched["device_usage"] > 0  # 70 computed tokens in 32-token blocks
        assert during["host_bytes"] == 0
    elif strategy == "discard":
        assert held == 0 and sched["device_usage"] == 0.0 and during["host_bytes"] == 0
    else:
        assert held == 0 and sched["device_usage"] == 0.0
        assert during["host_bytes"] > 0 and sched["host_tokens"] == 70 and len(during["host_requests"]) == 1
    assert after["scheduler"]["device_usage"] == 0.0 and after["host_bytes"] == 0


def test_faults_end_only_their_request(engine, loop_thread):
    async def scenario():
        started = asyncio.Event()

        async def boom(args):
            raise ValueError("the API is down")

        async def hang(args):
            await asyncio.sleep(3600)

        async def garbage(args):
            return {"not": "tokens"}

        async def out_of_vocab(args):
            return [5, 10**6]

        async def wait_forever(args):
            started.set()
            await asyncio.sleep(3600)

        for name, fn in [("boom", boom), ("hang", hang), ("garbage", garbage), ("oov", out_of_vocab),
                         ("forever", wait_forever)]:
            engine.tools.register(name, fn, timeout_s=60)

        def faulty(tool, timeout=None):
            return [Step(24, ToolCall(tool, timeout_s=timeout)), Step(8)]

        jobs = {
            "ok": engine.generate(P0, three_segments(0.5), strategy="swap", request_id="f-ok", ignore_eos=True),
            "boom": engine.generate(P0, faulty("boom"), strategy="swap", request_id="f-boom", ignore_eos=True),
            "hang": engine.generate(P0, faulty("hang", 0.5), strategy="swap", request_id="f-hang", ignore_eos=True),
            "garbage": engine.generate(P0, faulty("garbage"), strategy="preserve", request_id="f-garbage",
                                       ignore_eos=True),
            "oov": engine.generate(P0, faulty("oov"), strategy="discard", request_id="f-oov", ignore_eos=True),
            "abort": engine.generate(P0, faulty("forever"), strategy="swap", request_id="f-abort", ignore_eos=True),
        }
        tasks = {k: asyncio.ensure_future(v) for k, v in jobs.items()}
        await started.wait()
        await wait_state(engine, lambda s: "f-abort" in str(s["host_requests"]))  # its KV is on the host
        assert await engine.abort("f-abort")
        results = {k: await t for k, t in tasks.items()}
        reference = await engine.generate(P0, three_segments(0.0), ignore_eos=True)
        after = await wait_state(engine, idle)
        return results, reference, after

    results, reference, after = run(loop_thread, scenario())
    assert results["ok"].ok and results["ok"].token_ids == reference.token_ids
    assert "raised ValueError: the API is down" in results["boom"].error
    assert "timed out after 0.5 s" in results["hang"].error
    assert "returned garbage" in results["garbage"].error
    assert "outside the vocabulary" in results["oov"].error
    assert results["abort"].aborted and "aborted" in results["abort"].error
    for key in ("boom", "hang", "garbage", "oov", "abort"):
        assert len(results[key].segments[0].token_ids) == 24  # the segment ran; the call failed
    assert after["scheduler"]["paused"] == 0 and after["scheduler"]["running"] == 0


def test_live_tool_call_by_stop_token(engine, loop_thread):
    async def scenario():
        probe = await engine.generate(P0, [Step(40)], ignore_eos=True)
        tokens = probe.output_token_ids
        tool_token = tokens[10]
        first = tokens.index(tool_token)
        live = await engine.generate(P0, max_tokens=30, tool_tokens={tool_token: "calculator"},
                                     parse_args=lambda toks, text: "6*7", max_calls=1, ignore_eos=True,
                                     request_id="live")
        ref = await engine.generate(P0 + live.segments[0].token_ids + live.segments[0].returned_token_ids,
                                    [Step(len(live.segments[1].token_ids))], ignore_eos=True)
        return tokens, first, live, ref

    tokens, first, live, ref = run(loop_thread, scenario())
    assert live.ok, live.error
    assert live.segments[0].token_ids == tokens[: first + 1]
    assert live.segments[0].tool == "calculator" and live.segments[0].tool_args == "6*7"
    assert engine._tokenizer.decode(live.segments[0].returned_token_ids) == "42"
    assert live.segments[1].token_ids == ref.output_token_ids


@pytest.mark.stops_shared
def test_the_audit_stream_passes_the_mars_audit(runtime_engine, engine, loop_thread, tmp_path):
    # test_vllm_audit.py's stream under MARS's own strategies, sent once the engine is idle: the trace
    # from its first arrival to the engine's end is that of an engine that served it alone.
    run(loop_thread, wait_state(engine, idle))
    results = run(loop_thread, mixed_requests(engine, "audit"))
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]
    assert all(s.strategy is not None for r in results[:4] for s in r.segments[:2])  # MARS chose them
    runtime_engine.shutdown()  # this test is the engine's last: the trace gets its end
    events = ended_trace(engine.trace_file)
    assert schema_errors(events) == []  # every request of the module
    first = next(i for i, e in enumerate(events) if str(e.get("rid")).startswith("audit-"))
    alone = [events[0], *events[first:]]
    assert {e["rid"] for e in alone if e["event"] not in ("run", "end", "schedule")} == {r.request_id for r in results}
    path = tmp_path / "audit-stream.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in alone))
    assert_audited(path, "mars", REQUESTS)

"""A served request carries a learned length prediction, made in the front end, into the scheduler's trace.

The engine is `engines.LEARNED` (MARS with `predictor: learned`), started with the session.

Needs real vLLM and the `predict` extra (CI installs both: `scripts/setup.sh --vllm`).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json

import pytest

pytest.importorskip("vllm")
if importlib.util.find_spec("all_minilm_l6_v2") is None or importlib.util.find_spec("safetensors") is None:
    pytest.skip("the predict extra is not installed", allow_module_level=True)

from marsched.audit import audit_trace  # noqa: E402
from marsched.audit.keys import key_policy, recompute_key  # noqa: E402
from marsched.metrics.trace import read_trace  # noqa: E402
from marsched.predict.learned import load_model  # noqa: E402
from marsched.vllm import Step, ToolCall  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.predict, pytest.mark.timeout(600)]


def _raw_request(engine, rid: str, prompt: list[int], max_tokens: int):
    """A request as the API server sends it: its `rid`, no `predicted` (the number follows it)."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                            extra_args={"marsched": json.dumps({"rid": rid})})
    return engine.llm.generate({"prompt_token_ids": list(prompt)}, params, request_id=rid)


def test_a_prediction_told_before_during_or_after_its_wait_is_used_as_far_as_it_can_be(learned_engine):
    """The API server's number travels apart from its request (`told_predictions.py`). Told before
    the request arrives, the request takes it; told while it waits (the engine paused here, so
    that it waits), the request is predicted again and ranked by it; told once it runs, it is late."""
    from marsched.vllm.told_predictions import send_prediction

    engine, trace = learned_engine.engine, learned_engine.trace_file

    async def drain(generator, on_first=None):
        async for _ in generator:
            if on_first is not None:
                await on_first()
                on_first = None

    async def known(rid):
        for _ in range(200):
            request = (await engine.state(rid))["scheduler"]["request"]
            if request is not None:
                return request
            await asyncio.sleep(0.05)
        raise AssertionError(f"{rid} never reached the scheduler")

    async def counts():
        state = (await engine.state())["scheduler"]
        return [state[f"predictions_told_{when}"] for when in ("on_arrival", "while_waiting", "late")]

    async def scenario():
        prompt = engine._tokenizer.encode("count the files in this folder", add_special_tokens=False)
        seen = [await counts()]
        assert await send_prediction(engine.llm, "told-first", 33)
        await drain(_raw_request(engine, "told-first", prompt, 8))
        seen.append(await counts())
        await engine.llm.pause_generation(mode="keep", clear_cache=False)
        try:
            waiting = asyncio.ensure_future(drain(_raw_request(engine, "told-waiting", prompt, 8)))
            assert (await known("told-waiting"))["segments"][0]["prediction_source"] == "plan"
            await send_prediction(engine.llm, "told-waiting", 5)
            for _ in range(200):
                if (await known("told-waiting"))["segments"][0]["prediction_source"] == "front-end":
                    break
                await asyncio.sleep(0.05)
        finally:
            await engine.llm.resume_generation()
        await waiting
        seen.append(await counts())
        await drain(_raw_request(engine, "told-late", prompt, 24),
                    on_first=lambda: send_prediction(engine.llm, "told-late", 3))
        seen.append(await counts())
        return seen

    seen = learned_engine.run(scenario(), timeout=300)
    events = read_trace(trace)

    def predicts(rid):
        return [(e["output_tokens"], e["source"]) for e in events if e["event"] == "predict" and e["rid"] == rid]

    def admitted(rid):
        return next(e for e in events if e["event"] == "admit" and e["rid"] == rid)

    assert predicts("told-first") == [(33, "front-end")] and admitted("told-first")["predicted_output_tokens"] == 33
    assert predicts("told-waiting") == [(8, "plan"), (5, "front-end")]  # the plan's max_tokens, then the number
    waited = admitted("told-waiting")
    assert waited["predicted_output_tokens"] == 5
    run = next(e for e in events if e["event"] == "run")  # it left the queue with the key of the number
    assert waited["score"] == pytest.approx(recompute_key(key_policy(run["policy"]["name"], run["policy"]),
                                                          waited["key_basis"]), rel=1e-9)
    assert predicts("told-late") == [(24, "plan")]
    on_arrival, while_waiting, late = ([b - a for a, b in zip(seen[i], seen[i + 1])] for i in range(3))
    assert (on_arrival, while_waiting, late) == ([1, 0, 0], [0, 1, 0], [0, 0, 1])
    # A segment predicted twice, and ranked by the second, is sound; the engine runs on (no end yet).
    found = [v for v in audit_trace(trace, "mars").violations if "no end event" not in v.message]
    assert found == [], "\n".join(map(str, found))


def test_a_served_request_carries_a_learned_prediction(learned_engine):
    engine, trace = learned_engine.engine, learned_engine.trace_file
    model = load_model(None)

    async def scenario():
        prompt = engine._tokenizer.encode("please write a long story about a dragon", add_special_tokens=False)
        steps = [Step(12, ToolCall("sleep", {"duration_s": 0.1, "tokens": [100, 101, 102]})), Step(8)]
        result = await engine.generate(prompt, steps, request_id="learned-1", ignore_eos=True)
        return engine._tokenizer, prompt, result

    try:
        tokenizer, prompt, result = learned_engine.run(scenario(), timeout=300)
    finally:
        learned_engine.shutdown()  # the trace is whole
    assert result.ok, result.error
    expected = [model.predict_one(tokenizer.decode(prompt), len(prompt), 0),
                model.predict_one(tokenizer.decode([100, 101, 102]), len(prompt) + 12 + 3, 12)]
    events = [e for e in read_trace(trace) if e["event"] == "predict" and e["rid"] == "learned-1"]
    assert [e["segment"] for e in events] == [0, 1]
    assert [e["output_tokens"] for e in events] == expected
    assert all(e["predictor"] == "learned" and e["source"] == "front-end" for e in events)
    # the prediction, not the plan's 12 tokens, is what the policy fixed the strategy from
    assigned = next(e for e in read_trace(trace) if e["event"] == "assign_strategy" and e["rid"] == "learned-1")
    assert assigned["context_tokens"] == len(prompt) + expected[0]
    assert result.segments[0].predicted_output_tokens == expected[0]

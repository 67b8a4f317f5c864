"""A served request carries a learned length prediction, made in the front end, into the scheduler's trace.

The engine is `engines.LEARNED` (MARS with `predictor: learned`), started with the session.

Needs real vLLM and the `predict` extra (CI installs both: `scripts/setup.sh --vllm`).
"""

from __future__ import annotations

import importlib.util

import pytest

pytest.importorskip("vllm")
if importlib.util.find_spec("all_minilm_l6_v2") is None or importlib.util.find_spec("safetensors") is None:
    pytest.skip("the predict extra is not installed", allow_module_level=True)

from marsched.metrics.trace import read_trace  # noqa: E402
from marsched.predict.learned import load_model  # noqa: E402
from marsched.vllm import Step, ToolCall  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.predict, pytest.mark.timeout(600)]


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

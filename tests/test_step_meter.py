"""Stock vLLM's scheduler with a step meter (`vllm/step_meter.py`): vLLM's decisions, and the cost model
a marsched server would learn from the same steps, written to a file.

In-process `LLM` (conftest.py), so the test reaches the scheduler object."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from marsched.experiments.conversations.servers import metered_cost_model
from marsched.policy.cost_model import attention_pairs
from marsched.vllm.step_clock import METER_ENV, step_shape


def test_a_steps_shape_is_what_it_computed_on_what_came_before():
    output = SimpleNamespace(total_num_scheduled_tokens=103, num_scheduled_tokens={"a": 100, "b": 1, "gone": 2})
    requests = {"a": SimpleNamespace(num_computed_tokens=300), "b": SimpleNamespace(num_computed_tokens=50)}
    shape = step_shape(output, requests)
    assert (shape.tokens, shape.context_tokens, shape.sequences) == (103, 350, 3)
    assert shape.attention_pairs == attention_pairs(100, 200) + attention_pairs(1, 49)
    assert step_shape(SimpleNamespace(total_num_scheduled_tokens=0, num_scheduled_tokens={}), requests) is None


def test_the_meters_file_is_read_back_or_none(tmp_path):
    path = tmp_path / "step_costs.json"
    assert metered_cost_model(path) is None  # a marsched server's run: no file
    path.write_text('{"step_source": "learned", "steps": 40}')
    assert metered_cost_model(path) == {"step_source": "learned", "steps": 40}
    for bad in ("{", "[1, 2]"):
        path.write_text(bad)
        assert metered_cost_model(path) is None


def _generate(llm):
    from vllm import SamplingParams

    prompts = [{"prompt_token_ids": [(7 * i + j) % 500 + 4 for j in range(40 + 23 * i)]} for i in range(12)]
    params = [SamplingParams(temperature=0.0, max_tokens=34 + (3 * i) % 11, ignore_eos=True) for i in range(12)]
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def _engine(tiny_model, scheduler_cls):
    from vllm import LLM

    return LLM(model=tiny_model, dtype="float32", enforce_eager=True, block_size=32, max_model_len=512,
               num_gpu_blocks_override=64, enable_prefix_caching=True, seed=0, scheduler_cls=scheduler_cls)


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_the_meter_changes_no_decision_and_writes_what_a_server_would_learn(tiny_model, tmp_path, monkeypatch, caplog):
    pytest.importorskip("vllm")
    from vllm.v1.core.sched.scheduler import Scheduler

    from marsched.vllm.step_meter import MeteredScheduler

    stock = _engine(tiny_model, None)
    assert type(stock.llm_engine.engine_core.engine_core.scheduler) is Scheduler  # CPU: no async scheduling
    expected = _generate(stock)
    del stock

    meter = tmp_path / "step_costs.json"
    monkeypatch.setenv(METER_ENV, str(meter))
    llm = _engine(tiny_model, "marsched.vllm.step_meter.MeteredScheduler")
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    assert type(sched) is MeteredScheduler and type(sched).__mro__[1] is Scheduler
    assert _generate(llm) == expected
    written = json.loads(meter.read_text())  # written when the last request was done
    assert written["steps"] == sched._meter.step.steps >= written["min_steps"]
    assert written["step_source"] == "learned"
    assert written["seconds_per_iteration"] + written["seconds_per_token"] > 0
    assert written["run"]["steps"] == written["steps"]  # the whole run's fit, which the twin simulates at
    assert written == metered_cost_model(meter)

    # A file it cannot write ends the metering, not the engine.
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    sched._meter_file = blocker / "step_costs.json"
    assert _generate(llm) == expected
    assert sched._meter_file is None and "the step meter failed" in caplog.text
    del llm


def test_the_meter_refuses_to_start_without_its_file(monkeypatch):
    pytest.importorskip("vllm")
    from marsched.vllm.step_meter import meter_path

    for value in (None, "", "  "):
        environ = {} if value is None else {METER_ENV: value}
        with pytest.raises(ValueError, match=f"set {METER_ENV} to the JSON file"):
            meter_path(environ)
    assert str(meter_path({METER_ENV: "/tmp/x.json"})) == "/tmp/x.json"

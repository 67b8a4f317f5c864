"""A tool-calling chat on a fresh `marsched model`, served by `marsched serve` with no template
and no tool flags of its own: the model's tokenizer carries a chat template that renders tools,
calls and results, and `marsched serve` picks the tool-call parser that reads them (pythonic)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import NamedTuple

import pytest

pytest.importorskip("vllm")
openai = pytest.importorskip("openai")

from marsched.bench.model import ModelShape, build_model  # noqa: E402
from marsched.serve.launch import free_port  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

TINY = ModelShape(layers=2, hidden=128, heads=4, kv_heads=2, intermediate=256, vocab=512, max_position=1024)
CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string", "enum": ["6*7"]}},
                   "required": ["expression"], "additionalProperties": False}}}


def test_the_model_renders_tools_calls_and_results(tmp_path):
    from transformers import AutoTokenizer

    build_model(tmp_path / "model", TINY)
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "model"))
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is 6*7"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "calculator",
                                                                  "arguments": {"expression": "6*7"}}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "42"}]
    text = tokenizer.apply_chat_template(messages, tools=[CALCULATOR], tokenize=False, add_generation_prompt=True)
    assert text == ('<tools> calculator\n<system> be brief\n<user> what is 6*7\n'
                    '<assistant> [calculator(expression="6*7")]\n<tool> 42\n<assistant> ')


class Served(NamedTuple):
    model: str
    client: object
    process: subprocess.Popen
    trace: object  # Path of the scheduler's event trace
    log: object  # Path of marsched serve's output


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = tmp_path_factory.mktemp("model_chat")
    build_model(folder / "model", TINY)
    port = free_port("127.0.0.1")
    log = folder / "serve.log"
    command = [sys.executable, "-m", "marsched.cli", "serve", str(folder / "model"), "--port", str(port),
               "--cpu-kv-cache-gib", "1", "--trace-out", str(folder / "trace.jsonl"),
               # No tool flags: marsched serve picks the parser (marsched.serve.tool_parser).
               "--", "--enforce-eager", "--max-model-len", "1024",
               # JSON without whitespace, which a random model would otherwise write until max_tokens
               "--structured-outputs-config", '{"backend":"xgrammar","disable_any_whitespace":true}']
    # As a user runs it: the engine core and its worker in processes of their own (the suite's
    # conftest runs engines in-process), so that the state the workers report comes from the scheduler's steps.
    env = {key: value for key, value in os.environ.items() if key != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                   env=env)
    try:
        deadline = time.monotonic() + 300
        while "marsched serve: listening on" not in log.read_text():
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
        yield Served(str(folder / "model"), client, process, folder / "trace.jsonl", log)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=60)


def test_a_fresh_server_reports_its_scheduler_before_any_request(served):
    """The scheduler publishes its state once at the start (no request has run: this test is the
    module's first on the server)."""
    import urllib.request

    base = str(served.client.base_url).removesuffix("/v1/").removesuffix("/v1")
    deadline = time.monotonic() + 30
    while True:
        with urllib.request.urlopen(f"{base}/marsched/state", timeout=30) as response:
            state = json.loads(response.read())
        with urllib.request.urlopen(f"{base}/metrics", timeout=30) as response:
            metrics = response.read().decode()
        if "scheduler" in state or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert state["scheduler"]["tracked"] == 0 and state["scheduler"]["running"] == 0  # its one step was empty
    assert state["scheduler"]["device_free_blocks"] == state["scheduler"]["device_total_blocks"]
    assert 'marsched_state_up{rank="0"} 1.0' in metrics


def test_the_startup_line_names_the_parser_it_picked(served):
    started = next(line for line in served.log.read_text().splitlines() if "marsched serve: starting vLLM" in line)
    assert "tool-call parser pythonic (the chat template of `marsched model`), auto tool choice on" in started
    assert "warning: no tool-call parser" not in served.log.read_text()


def test_a_tool_calling_chat_runs_end_to_end(served):
    model, client = served.model, served.client
    messages = [{"role": "user", "content": "what is 6*7?"}]
    # A named tool_choice makes the random model write a valid call (structured output).
    first = client.chat.completions.create(model=model, messages=messages, tools=[CALCULATOR], max_tokens=32,
                                           tool_choice={"type": "function", "function": {"name": "calculator"}})
    call = first.choices[0].message.tool_calls[0]
    assert call.function.name == "calculator" and json.loads(call.function.arguments) == {"expression": "6*7"}
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "42"}]
    answer = client.chat.completions.create(model=model, messages=messages, tools=[CALCULATOR], max_tokens=8)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # "auto" (the default with tools) is served too (HTTP 400 without a parser): the parser reads
    # whatever the model wrote.
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": "hi"}], tools=[CALCULATOR], max_tokens=4)
    assert raw.status_code == 200
    assert raw.parse().choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_sigterm_stops_the_server_with_its_trace_complete(served):
    """As a supervisor stops it (this module's last test): `marsched serve` exits 0, and the
    engine core wrote the trace's `end` event on its way out, so the audit passes."""
    from marsched.audit import audit_trace
    from marsched.metrics.trace import read_trace

    served.process.send_signal(signal.SIGTERM)
    assert served.process.wait(timeout=90) == 0
    events = list(read_trace(served.trace))
    assert events[-1]["event"] == "end" and events[-1]["kv_device_blocks"] == 0
    assert sum(e["event"] == "finish" for e in events) == 3  # the chat's three requests
    assert audit_trace(served.trace).clean

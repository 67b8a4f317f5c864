"""Server-side tools: `marsched serve --tools FILE` runs the tool loop of a chat request itself.

The session's tools server (`servers.TOOLS`: tiny random-weight model, CPU; shared with
test_serve_retention_pressure), driven with the official `openai` client. A named tool_choice
makes the random model emit a valid call (structured output, JSON without whitespace); the
chat template renders calls and results, so a request built by hand with the same messages is
the reference the loop's answer must equal token for token (a different cache_salt: nothing
reused). The tools are Python functions of a
module written next to the server (`servers.TOOLS_MODULE`); they record their calls to a file.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from servers import CITY, Server, tool_calls_record  # noqa: E402

from marsched.metrics.trace import read_trace  # noqa: E402

from marsched.serve.launch import TOOLS_MIDDLEWARE, ServeOptions, vllm_command, vllm_environment  # noqa: E402
from marsched.serve.server_tools import DurationEstimate, ServerToolsMiddleware  # noqa: E402
from marsched.serve.tool_config import ToolsConfigError, load_tools_config  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def setup(tools_server):
    """The session's tools server (`servers.TOOLS`: its tools module records each call to a file)."""
    client = openai.OpenAI(base_url=tools_server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    yield tools_server, client, tool_calls_record(tools_server.folder)
    client.close()


def calls(record: Path) -> list[dict]:
    return [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


def ask(client, model: str, tool: str, **fields):
    """A chat that forces a call of `tool` (a server-side one, sent by name only)."""
    return client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "search the web for the weather in paris"}],
        tools=[named(tool)], tool_choice=named(tool), max_tokens=MAX_TOKENS, temperature=0, logprobs=True,
        **fields)


def by_hand(client, model: str, tool: str, arguments: str, result: str, first: bool = False):
    """The reference: the same conversation sent as one plain request (a client-side twin of the tool,
    so the server runs nothing), with its own cache_salt."""
    user = {"role": "user", "content": "search the web for the weather in paris"}
    twin = {"type": "function", "function": {"name": "twin_" + tool, "parameters": CITY}}
    if first:  # the first round: the forced call itself
        return client.chat.completions.create(model=model, messages=[user], tools=[twin],
                                              tool_choice=named("twin_" + tool), max_tokens=MAX_TOKENS,
                                              temperature=0, extra_body={"cache_salt": "reference"})
    messages = [user,
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call-1", "type": "function", "function": {"name": tool, "arguments": arguments}}]},
                {"role": "tool", "tool_call_id": "call-1", "content": result}]
    return client.chat.completions.create(model=model, messages=messages, tools=[twin], tool_choice="auto",
                                          max_tokens=MAX_TOKENS, temperature=0, logprobs=True,
                                          extra_body={"cache_salt": "reference"})


def tokens(completion) -> list[str]:
    return [t.token for t in completion.choices[0].logprobs.content]


def releases(server: Server) -> int:
    """Retentions the scheduler ended because the front end released them."""
    return server.state()["scheduler"]["retention_released"]


def wait_for(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


# --- the live server -------------------------------------------------------------------------


def test_a_server_side_tool_runs_and_the_answer_is_one_completion(setup):
    server, client, record = setup
    before, released = len(calls(record)), releases(server)
    answer = ask(client, server.model, "weather")
    ran = calls(record)[before:]
    assert [c["tool"] for c in ran] == ["weather"] and ran[0]["args"] == {"city": "paris"}
    message = answer.choices[0].message
    assert not message.tool_calls and message.content, answer  # the model's answer after the tool result
    # Token continuity: the same tokens as the conversation sent by hand in one request.
    arguments = json.dumps(ran[0]["args"], separators=(",", ":"))
    reference = by_hand(client, server.model, "weather", arguments, "sunny in paris")
    assert tokens(answer) == tokens(reference) and message.content == reference.choices[0].message.content
    assert tokens(by_hand(client, server.model, "weather", arguments, "rainy in oslo")) != tokens(answer)  # it tells
    # Usage: both rounds.
    first = by_hand(client, server.model, "weather", "", "", first=True)
    assert first.choices[0].message.tool_calls[0].function.arguments == arguments
    assert answer.usage.prompt_tokens == first.usage.prompt_tokens + reference.usage.prompt_tokens
    assert answer.usage.completion_tokens == first.usage.completion_tokens + reference.usage.completion_tokens
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + answer.usage.completion_tokens
    # Every round named the conversation and the tool's predicted duration; the end released it.
    wait_for(lambda: releases(server) == released + 1)
    log = server.log.read_text()
    assert '\\"conversation\\":\\"srv-' in log or '"conversation":"srv-' in log, log[-2000:]
    assert "tool_s" in log


def test_the_builtin_calculator(setup):
    server, client, record = setup
    answer = ask(client, server.model, "calculator")
    assert not answer.choices[0].message.tool_calls
    reference = by_hand(client, server.model, "calculator", '{"expression":"6*7"}', "42")
    assert tokens(answer) == tokens(reference)


@pytest.mark.parametrize("tool, seen", [
    ("boom", "error: tool 'boom' raised RuntimeError: kaboom"),
    ("slow", "error: tool 'slow' timed out after 0.5 s"),
    ("number", "error: tool 'number' returned int, not a string"),
    ("garbage", "a\ufffdb\ufffdc"),  # what no tokenizer takes is replaced, not a 400 for the client
])
def test_a_failing_tool_is_an_error_the_model_reads(setup, tool, seen):
    server, client, record = setup
    answer = ask(client, server.model, tool)
    assert answer.choices[0].finish_reason in ("stop", "length") and not answer.choices[0].message.tool_calls
    reference = by_hand(client, server.model, tool, '{"city":"paris"}', seen)
    assert tokens(answer) == tokens(reference)


def test_stream_with_a_server_tool_is_a_400(setup):
    server, client, record = setup
    with pytest.raises(openai.BadRequestError) as error:
        ask(client, server.model, "weather", stream=True)
    assert "stream=true is not supported with server-side tools" in str(error.value)


def test_requests_without_server_tools_pass_through(setup):
    server, client, record = setup
    before, released = len(calls(record)), releases(server)
    twin = {"type": "function", "function": {"name": "client_side", "parameters": CITY}}
    plain = client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "hi"}], tools=[twin],
        tool_choice=named("client_side"), max_tokens=MAX_TOKENS, temperature=0)
    assert plain.choices[0].message.tool_calls[0].function.name == "client_side"
    # A client-side call among server-side tools ends the loop: it goes back to the client.
    mixed = client.chat.completions.create(  # long enough to fill a block: the scheduler keeps it
        model=server.model, messages=[{"role": "user", "content": "hi " * 40}], tools=[named("weather"), twin],
        tool_choice=named("client_side"), max_tokens=MAX_TOKENS, temperature=0)
    assert mixed.choices[0].message.tool_calls[0].function.name == "client_side"
    assert len(calls(record)) == before
    wait_for(lambda: releases(server) == released + 1)  # the mixed one had a conversation; the plain one not
    bad = server.post("/v1/chat/completions", raw=b'{"model": "x", "tools": [')  # vLLM's own answer
    assert bad.status_code == 400


def test_the_clients_marsched_object_is_kept_and_its_conversation_continues(setup):
    server, client, record = setup
    released = releases(server)
    twin = {"type": "function", "function": {"name": "client_side", "parameters": CITY}}
    mixed = client.chat.completions.create(  # long enough to fill a block: the scheduler keeps it
        model=server.model, messages=[{"role": "user", "content": "hi " * 40}], tools=[named("weather"), twin],
        tool_choice=named("client_side"), max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"vllm_xargs": {"marsched": json.dumps({"rid": "client-rid", "conversation": "client-conv"})}})
    assert mixed.choices[0].message.tool_calls[0].function.name == "client_side"
    assert any(e.get("rid") == "client-rid" for e in read_trace(server.trace))
    assert '"conversation":"client-conv"' in server.log.read_text()
    time.sleep(1.0)
    assert releases(server) == released  # client-side calls on the client's conversation: it goes on


def test_a_client_that_leaves_while_a_tool_runs_cancels_it_and_releases(setup):
    server, client, record = setup
    released = releases(server)
    body = {"model": server.model, "messages": [{"role": "user", "content": "hi " * 40}], "tools": [named("nap")],
            "tool_choice": named("nap"), "max_tokens": MAX_TOKENS, "temperature": 0}

    naps = sum(c["tool"] == "nap" and c["event"] == "call" for c in calls(record))
    # The client leaves once the tool runs (not after a fixed time, which a slow machine may not reach it in).
    url = httpx.URL(server.url)
    payload = json.dumps(body).encode()
    with socket.create_connection((url.host, url.port)) as client_socket:
        client_socket.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                              b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
        wait_for(lambda: sum(c["tool"] == "nap" and c["event"] == "call" for c in calls(record)) > naps, 120)
    wait_for(lambda: any(c["tool"] == "nap" and c["event"] == "cancelled" for c in calls(record)))
    wait_for(lambda: releases(server) == released + 1)


# --- without a model -------------------------------------------------------------------------


class Recorder:
    """A downstream app that records the body it receives and answers with a fixed JSON."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []

    async def __call__(self, scope, receive, send) -> None:
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        self.bodies.append(b"".join(chunks))
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"ok"})


def drive(handler, body: bytes, **scope_fields) -> tuple[int, bytes]:
    sent: list[dict] = []
    parts = [body[:5], body[5:]]  # in two chunks, as a client may send it

    async def receive():
        if parts:
            part = parts.pop(0)
            return {"type": "http.request", "body": part, "more_body": bool(parts)}
        await asyncio.sleep(3600)

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": [], **scope_fields}
    asyncio.run(handler(scope, receive, send))
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


@pytest.fixture()
def builtin_only(tmp_path):
    path = tmp_path / "tools.json"
    path.write_text(json.dumps({"tools": [{"name": "calculator", "builtin": "calculator"}]}))
    return load_tools_config(path)


def test_passthrough_is_byte_for_byte(builtin_only):
    recorder = Recorder()
    middleware = ServerToolsMiddleware(recorder, builtin_only)
    bodies = [b'{ "model":"m",  "messages": [], "tools": [{"type": "function", "function": {"name": "other"}}]}',
              b'{"model": "m", "messages": [{"role": "user", "content": "\\u00e9"}]}',
              b'{"tools": [', b'\xff\xfe not json', b'[1, 2]']
    for body in bodies:
        assert drive(middleware, body) == (200, b"ok")
    assert recorder.bodies == bodies


class AlwaysCalls:
    """A downstream app whose model always calls the calculator."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []

    async def __call__(self, scope, receive, send) -> None:
        self.bodies.append(json.loads((await receive())["body"]))
        call = {"id": f"c{len(self.bodies)}", "type": "function",
                "function": {"name": "calculator", "arguments": '{"expression": "1+2"}'}}
        answer = {"id": "x", "object": "chat.completion", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": None, "tool_calls": [call]},
             "finish_reason": "tool_calls"}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}}
        data = json.dumps(answer).encode()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"1")]})
        await send({"type": "http.response.body", "body": data})


class Engine:
    """An engine client whose core records the messages it is sent (`send_release`)."""

    def __init__(self) -> None:
        self.aborted: list[str] = []
        self.engine_core = self

    async def abort_requests_async(self, request_ids):
        self.aborted.extend(request_ids)


def test_the_loop_stops_at_max_rounds_and_sums_usage(tmp_path):
    path = tmp_path / "tools.json"
    path.write_text(json.dumps({"tools": [{"name": "calculator", "builtin": "calculator", "expected_s": 3}],
                                "max_rounds": 2}))
    downstream, engine = AlwaysCalls(), Engine()
    middleware = ServerToolsMiddleware(downstream, load_tools_config(path))
    body = {"model": "m", "messages": [{"role": "user", "content": "add"}], "tools": [named("calculator")],
            "tool_choice": "required", "vllm_xargs": {"marsched": json.dumps({"rid": "mine", "tool_s": 9})}}
    app = type("App", (), {"state": type("State", (), {"engine_client": engine})()})()
    status, data = drive(middleware, json.dumps(body).encode(), app=app)
    answer = json.loads(data)
    assert status == 200 and answer["choices"][0]["message"]["tool_calls"][0]["id"] == "c2"  # handed back
    assert answer["usage"] == {"prompt_tokens": 20, "completion_tokens": 10, "total_tokens": 30}
    first, second = downstream.bodies
    assert first["tools"][0]["function"]["parameters"]["required"] == ["expression"]  # filled in
    assert [first["tool_choice"], second["tool_choice"]] == ["required", "auto"]
    assert second["messages"][1:] == [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "1+2"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "3"}]
    metas = [json.loads(b["vllm_xargs"]["marsched"]) for b in downstream.bodies]
    conversation = metas[0]["conversation"]
    assert conversation.startswith("srv-") and all(m == {"conversation": conversation, "tool_s": 9, "rid": "mine"}
                                                   for m in metas)  # the client's keys win
    assert engine.aborted == ["marsched-release:" + conversation]
    # Without a client tool_s, the estimate: the prior, then the mean of the calls.
    body["vllm_xargs"] = {"marsched": json.dumps({"conversation": "client-1"})}
    downstream.bodies.clear()
    drive(middleware, json.dumps(body).encode(), app=app)
    metas = [json.loads(b["vllm_xargs"]["marsched"]) for b in downstream.bodies]
    assert metas[0]["conversation"] == metas[1]["conversation"] == "client-1"
    assert metas[0]["tool_s"] < 1 and engine.aborted[-1] == "marsched-release:client-1"


def test_a_registered_tool_the_request_does_not_offer_is_not_run(tmp_path):
    path = tmp_path / "tools.json"
    path.write_text(json.dumps({"tools": [{"name": "calculator", "builtin": "calculator"},
                                          {"name": "nap", "builtin": "sleep"}]}))
    downstream = AlwaysCalls()
    middleware = ServerToolsMiddleware(downstream, load_tools_config(path))
    body = {"model": "m", "messages": [], "tools": [named("nap")]}
    status, data = drive(middleware, json.dumps(body).encode())
    assert status == 200 and len(downstream.bodies) == 1  # the calculator call went back to the client
    assert json.loads(data)["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "calculator"


def test_a_failed_release_is_logged_not_raised(builtin_only, caplog):
    class Broken:
        engine_core = None  # has no abort_requests_async: the release fails

    downstream = AlwaysCalls()
    middleware = ServerToolsMiddleware(downstream, builtin_only)
    body = {"model": "m", "messages": [], "tools": [named("calculator")]}
    app = type("App", (), {"state": type("State", (), {"engine_client": Broken()})()})()
    status, _ = drive(middleware, json.dumps(body).encode(), app=app)
    assert status == 200 and "could not release conversation srv-" in caplog.text and "AttributeError" in caplog.text


def test_stream_and_n_are_refused_before_vllm(builtin_only):
    recorder = Recorder()
    middleware = ServerToolsMiddleware(recorder, builtin_only)
    for field, value in (("stream", True), ("n", 2)):
        body = {"model": "m", "messages": [], "tools": [named("calculator")], field: value}
        status, answer = drive(middleware, json.dumps(body).encode())
        assert status == 400 and json.loads(answer)["error"]["param"] == field
    assert recorder.bodies == []


def test_a_results_nul_and_lone_surrogates_are_replaced_and_the_rest_kept():
    from marsched.serve.server_tools import readable

    assert readable("a\x00b\ud800c\udfff\U0001F600 é") == "a\ufffdb\ufffdc\ufffd\U0001F600 é"
    assert readable("plain") == "plain"


def test_the_duration_estimate_starts_from_the_prior_then_is_the_mean():
    estimate = DurationEstimate(2.0)
    assert estimate.seconds == 2.0
    estimate.observe(1.0)
    estimate.observe(3.0)
    assert estimate.seconds == 2.0 and estimate.runs == 2
    estimate.observe(8.0)
    assert estimate.seconds == 4.0


def test_tools_add_the_middleware_and_the_path(tmp_path):
    assert TOOLS_MIDDLEWARE not in vllm_command(ServeOptions("m"))
    options = ServeOptions("m", tools="tools.json")
    command = vllm_command(options)
    assert command[command.index(TOOLS_MIDDLEWARE) - 1] == "--middleware"
    assert vllm_environment(options, {})["MARSCHED_TOOLS"] == str(Path("tools.json").absolute())


# --- the tools file --------------------------------------------------------------------------


@pytest.mark.parametrize("config, problem", [
    ({"tools": []}, "tools must be a non-empty list"),
    ({"tools": [{"name": "c", "builtin": "abacus"}]}, "tools[0] ('c'): builtin must be one of"),
    ({"tools": [{"name": "c", "builtin": "calculator"}, {"name": "c", "builtin": "sleep"}]},
     "tools[1] ('c'): the name is already used"),
    ({"tools": [{"name": "f", "function": "no_such_module_x:fn"}]},
     "tools[0] ('f'): function 'no_such_module_x:fn': cannot import no_such_module_x"),
    ({"tools": [{"name": "f", "function": "json:nope"}]}, "json has no attribute 'nope'"),
    ({"tools": [{"name": "f", "function": "json:dumps", "timeout_s": 0}]}, "timeout_s must be"),
    ({"tools": [{"name": "f", "function": "json:dumps", "parameters": {"type": "string"}}]}, "parameters must be"),
    ({"tools": [{"name": "bad name", "builtin": "calculator"}]}, "name must be"),
    ({"tools": [{"name": "c", "builtin": "calculator", "colour": 1}]}, "unknown key 'colour'"),
    ({"tools": [{"name": "c", "builtin": "calculator"}], "max_rounds": 0}, "max_rounds must be"),
])
def test_a_bad_tools_file_is_named_with_its_problem(tmp_path, config, problem):
    path = tmp_path / "tools.json"
    path.write_text(json.dumps(config))
    with pytest.raises(ToolsConfigError) as error:
        load_tools_config(path)
    assert str(error.value).startswith(f"tools file {path}: ") and problem in str(error.value), str(error.value)


def test_marsched_serve_refuses_a_bad_tools_file_before_starting_vllm(tmp_path):
    path = tmp_path / "tools.json"
    path.write_text('{"tools": [{"name": "lookup", "function": "no_such_module_x:fn"}]}')
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "marsched.cli", "serve", "some-model", "--tools", str(path)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert str(path) in output and "tools[0] ('lookup')" in output and "cannot import no_such_module_x" in output
    assert "starting vLLM" not in output and time.monotonic() - started < 60

"""`marsched serve` as a user runs it: a live server (tiny model, CPU, loopback), fuzzed.

The session's chat server (`servers.CHAT`: `marsched serve` in a subprocess, on a free port,
shared with test_serve_conversations and test_serve_metrics). Malformed marsched fields and
malformed bodies (hypothesis) must each get a 4xx and never reach the engine core (the
scheduler's event trace records every request that arrives); afterwards the server answers a
normal request and device and host KV usage are back to zero (the scheduler's own state at
`/marsched/state`, and vLLM's `vllm:kv_cache_usage_perc`). The last test on the server stops it
as Ctrl-C does and checks that every process it started is gone.
"""

from __future__ import annotations

import json
import random
import signal
import time

import pytest

pytest.importorskip("vllm")
httpx = pytest.importorskip("httpx")
psutil = pytest.importorskip("psutil")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from marsched.experiments.probe.fields import fuzz_body, verdict  # noqa: E402
from marsched.metrics.trace import read_trace  # noqa: E402
from servers import Server, completion, wait_idle  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

FUZZ_CASES = 1000
OPENAI_FUZZ_CASES = 150


@pytest.fixture(scope="module")
def server(chat_server):
    return chat_server


def chat(server: Server, **fields) -> dict:
    return {"model": server.model, "messages": [{"role": "user", "content": "call the calculator"}],
            "max_tokens": 4, **fields}


def meta(**fields) -> str:
    return json.dumps({"plan": [[4, "math", 0.5, 3], [4, None, 0, 0]], **fields})


def test_serve_prints_where_it_listens_and_serves(server):
    log = server.log.read_text()
    assert f"marsched serve: listening on {server.url} (OpenAI API {server.url}/v1" in log
    response = server.post("/v1/completions", completion(server, vllm_xargs={"marsched": meta(rid="hello")}))
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 4
    assert any(e.get("rid") == "hello" for e in read_trace(server.trace))  # the metadata reached the scheduler


def test_valid_requests_of_every_kind_run_and_free_their_memory(server):
    bodies = [
        ("/v1/completions", completion(server, vllm_xargs={"marsched": meta(strategy="swap", rid="v1")})),
        ("/v1/completions", completion(server, vllm_xargs={"marsched": meta(strategy="discard")}, n=2)),
        ("/v1/completions", completion(server, vllm_xargs={"marsched": "{}"})),
        ("/v1/completions", completion(server, stream=True, vllm_xargs={"marsched": meta(segment=0)})),
        ("/v1/chat/completions", chat(server, vllm_xargs={"marsched": meta(strategy="preserve")})),
        ("/v1/chat/completions", chat(server, stream=True)),
        ("/v1/completions", completion(server, prompt=[10, 20, 30], max_tokens=16)),
    ]
    for path, body in bodies:
        response = server.post(path, body)
        assert response.status_code == 200, (path, body, response.text)
    wait_idle(server)


# --- the fuzz ---------------------------------------------------------------------------------

ints = st.integers(min_value=-(10**20), max_value=10**20)
not_int = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8), st.booleans(),
                    st.lists(st.integers(), max_size=3), st.none())
scalars = st.one_of(st.integers(), st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=20))


def _json_constant(value: float) -> str:
    return json.dumps(value)  # NaN, Infinity, -Infinity: JSON extensions our parser refuses


@st.composite
def bad_metadata_object(draw) -> str:
    """A JSON object that is wrong in exactly one documented way (docs/vllm-plugin.md)."""
    valid_item = [4, "math", 0.5, 3]
    plan = [list(valid_item), [4, None, 0, 0]]
    data: dict = {"plan": plan, "segment": 0, "strategy": "swap", "rid": "r"}
    kind = draw(st.sampled_from(["plan", "plan-empty", "plan-long", "item", "out", "api", "api_s", "ret",
                                 "segment", "strategy", "rid", "unknown", "nan"]))
    index = draw(st.integers(0, 1))
    if kind == "plan":
        data["plan"] = draw(st.one_of(scalars, st.booleans(), st.dictionaries(st.text(max_size=3), st.integers(),
                                                                             max_size=2)))
    elif kind == "plan-empty":
        data["plan"] = []
    elif kind == "plan-long":
        data["plan"] = [[1, None, 0, 0]] * draw(st.integers(1025, 1100))
    elif kind == "item":
        plan[index] = draw(st.one_of(scalars, st.lists(st.integers(0, 5), max_size=6).filter(lambda x: len(x) != 4)))
    elif kind in ("out", "ret"):
        position = 0 if kind == "out" else 3
        plan[index][position] = draw(st.one_of(not_int, ints.filter(lambda v: not 0 <= v <= 10_000_000)))
    elif kind == "api":
        plan[index][1] = draw(st.one_of(st.text(max_size=10).filter(
            lambda t: t not in ("math", "qa", "ve", "chatbot", "tts", "image", "tool", "other")),
            st.integers(), st.booleans(), st.lists(st.integers(), max_size=2)))
    elif kind == "api_s":
        plan[index][2] = draw(st.one_of(
            st.floats(max_value=-1e-9), st.floats(min_value=1e6 + 1, allow_infinity=False),
            st.text(max_size=5), st.booleans(), st.lists(st.integers(), max_size=2)))
    elif kind == "segment":
        data["segment"] = draw(st.one_of(st.floats(), st.text(max_size=5), st.booleans(),
                                         ints.filter(lambda v: not 0 <= v <= 1024)))
    elif kind == "strategy":
        data["strategy"] = draw(st.one_of(st.text(max_size=10).filter(lambda t: t not in ("preserve", "discard", "swap")),
                                          st.integers(), st.booleans()))
    elif kind == "rid":
        data["rid"] = draw(st.one_of(st.just(""), st.text(min_size=1025, max_size=1100), st.integers(), st.booleans(),
                                     st.lists(st.text(max_size=3), max_size=2)))
    elif kind == "unknown":
        data[draw(st.text(min_size=1, max_size=12).filter(lambda k: k not in data))] = draw(scalars)
    else:  # a non-finite number, as JSON's NaN / Infinity extensions
        text = json.dumps(data).replace('0.5', _json_constant(draw(st.sampled_from(
            [float("nan"), float("inf"), float("-inf")]))), 1)
        return text
    return json.dumps(data)


bad_marsched = st.one_of(
    st.integers(), st.floats(allow_nan=False, allow_infinity=False),  # not a JSON object
    st.lists(st.one_of(st.integers(), st.text(max_size=5)), max_size=4),
    st.text(max_size=40).filter(lambda t: not t.lstrip().startswith("{")),  # not JSON, or not an object
    st.builds(json.dumps, st.one_of(st.lists(st.integers(), max_size=3), st.integers(), st.text(max_size=5))),
    bad_metadata_object(),
)


@st.composite
def malformed_request(draw, server_model: str) -> tuple[str, bytes, bool]:
    """(path, body, whether vLLM sends a pre-aborted request to the engine for it): always invalid."""
    path = draw(st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
    if path == "/v1/completions":
        body: dict = {"model": server_model, "prompt": "the quick", "max_tokens": 4}
    else:
        body = {"model": server_model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    kind = draw(st.sampled_from(["marsched", "marsched", "marsched", "xargs", "body", "field", "kv"]))
    if kind == "marsched":
        body["vllm_xargs"] = {"marsched": draw(bad_marsched)}
    elif kind == "xargs":  # vllm_xargs itself malformed, or an object where vLLM reads objects
        body["vllm_xargs"] = draw(st.one_of(
            scalars, st.lists(st.integers(), max_size=2),
            st.builds(lambda v: {"marsched": v}, st.dictionaries(st.text(max_size=3), st.integers(), max_size=2)),
            st.builds(lambda v: {"kv_transfer_params": v}, st.one_of(scalars, st.lists(st.integers(), max_size=2))),
            st.builds(lambda v: {"ec_transfer_params": v}, st.one_of(scalars, st.lists(st.integers(), max_size=2))),
        ))
    elif kind == "body":  # not a JSON object at all
        return path, draw(st.one_of(
            st.binary(max_size=30).filter(lambda b: not b.strip().startswith(b"{")),
            st.builds(lambda v: json.dumps(v).encode(), st.one_of(scalars, st.lists(st.integers(), max_size=3))),
        )), False
    elif kind == "field":  # one of vLLM's own fields out of its range or of the wrong type
        name, value = draw(st.one_of(
            st.tuples(st.just("max_tokens"), st.one_of(st.integers(max_value=0), st.integers(513, 10**30),
                                                       st.text(alphabet="abcxyz", min_size=1, max_size=4))),
            st.tuples(st.just("temperature"), st.floats(max_value=-1e-6, allow_infinity=False)),
            st.tuples(st.just("n"), st.integers(max_value=0)),
            st.tuples(st.just("model"), st.text(alphabet="abcxyz/-", min_size=1, max_size=10)),
        ))
        body[name] = value
    else:  # KV-transfer parameters on a request that is rejected: vLLM notifies the engine
        body["kv_transfer_params"] = {"do_remote_prefill": True}
        body["vllm_xargs"] = {"marsched": draw(bad_marsched)}
        return path, json.dumps(body, allow_nan=True).encode(), True
    return path, json.dumps(body, allow_nan=True).encode(), False


def test_fuzz_malformed_marsched_fields_and_bodies_get_4xx_and_leave_no_trace(server):
    arrivals_before = server.arrivals()
    seen = {"cases": 0, "notified": 0, "ours": 0}

    @settings(max_examples=FUZZ_CASES, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(case=malformed_request(server.model))
    def fuzz(case):
        path, body, notifies = case
        response = server.post(path, raw=body)
        assert 400 <= response.status_code < 500, (path, body[:300], response.status_code, response.text[:500])
        seen["cases"] += 1
        seen["notified"] += notifies
        try:
            param = response.json()["error"]["param"] or ""
        except (ValueError, KeyError, TypeError):
            param = ""
        seen["ours"] += param.startswith(("vllm_xargs.marsched", "vllm_xargs.kv_transfer", "vllm_xargs.ec_transfer"))

    started = time.monotonic()
    fuzz()
    elapsed = time.monotonic() - started
    print(f"fuzz: {seen['cases']} cases in {elapsed:.1f} s; {seen['ours']} rejected by the marsched validator")
    assert seen["cases"] >= 200
    assert seen["ours"] >= 100  # most cases exercise the marsched fields, not only vLLM's own checks
    assert server.client.get(server.url + "/health").status_code == 200
    response = server.post("/v1/completions", completion(server, vllm_xargs={"marsched": meta(rid="after-fuzz")}))
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4, response.text
    wait_idle(server)
    # Nothing rejected reached the scheduler: the only arrivals are the request after the fuzz and
    # vLLM's pre-aborted notices for rejected requests that carried KV-transfer parameters.
    assert server.arrivals() - arrivals_before == 1 + seen["notified"]


def test_fuzz_openai_fields_get_a_2xx_or_a_4xx_naming_the_field(server):
    """The OpenAI fields users send (seed, n, stop, logprobs, response_format, tools, tool_choice,
    max_tokens extremes, stream and its options), valid and not, a few at a time
    (`marsched.experiments.probe.fields`): each request gets a 2xx or a 4xx naming one of them."""
    # First the cases the soak found vLLM 0.32 answering with a 500 or an unnamed 400.
    named = {"type": "function", "function": {"name": "get_weather"}}
    for tools, field in (([{"type": "function"}], "tools[0].function"), ("calculator", "tools")):
        response = server.post("/v1/chat/completions", chat(server, tools=tools, tool_choice=named))
        assert response.status_code == 400 and response.json()["error"]["param"] == field, response.text
    rng = random.Random(0)
    judged = {"2xx": 0, "4xx": 0}
    for _ in range(OPENAI_FUZZ_CASES):
        path, body = fuzz_body(rng, server.model)
        sent = {k: v for k, v in body.items() if k not in ("model", "messages", "prompt")}
        response = server.post(path, body)
        answer = verdict(response.status_code, response.text, sent)
        assert answer.ok, (path, sent, answer.why)
        judged[answer.why[:3]] += 1
    print(f"OpenAI-field fuzz: {judged}")
    assert judged["2xx"] >= OPENAI_FUZZ_CASES // 10 and judged["4xx"] >= OPENAI_FUZZ_CASES // 10
    assert server.client.get(server.url + "/health").status_code == 200
    response = server.post("/v1/completions", completion(server))
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4, response.text
    wait_idle(server)


def test_bad_marsched_values_are_named_in_the_400(server):
    cases = {
        "garbage": "vllm_xargs.marsched",
        5: "vllm_xargs.marsched",
        json.dumps({"plan": [[4, "math", -1, 3]]}): "vllm_xargs.marsched.plan[0][2]",
        json.dumps({"plan": [[4, "nope", 1, 3]]}): "vllm_xargs.marsched.plan[0][1]",
        json.dumps({"strategy": "keep"}): "vllm_xargs.marsched.strategy",
        json.dumps({"colour": "red"}): "vllm_xargs.marsched.colour",
    }
    for value, field in cases.items():
        response = server.post("/v1/completions", completion(server, vllm_xargs={"marsched": value}))
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == field and error["message"].startswith(field), error


@pytest.mark.stops_shared
def test_ctrl_c_stops_the_server_and_every_process_it_started(server):
    server.note_descendants()
    assert len(server.descendants) >= 2  # vLLM's API server and its engine core (and its worker)
    started = time.monotonic()
    status = server.stop(signal.SIGINT)
    assert status == 0, server.log.read_text()[-3000:]
    deadline = time.monotonic() + 10
    while server.alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not server.alive(), [p.cmdline() for p in server.alive()]
    assert "marsched serve: stopped (SIGINT)" in server.log.read_text()
    print(f"stopped in {time.monotonic() - started:.1f} s")

"""Every HTTP request predicted in the API server, on a live `marsched serve` (the session's chat
server, `servers.CHAT`, which runs the default predictor: learned, with the predict extra).

The prediction a response's `x-marsched-predicted` header reports is the one the scheduler ranked
the request by, when it came before the request's admission (`/marsched/state?request_id=` under
the response's `x-marsched-request-id` says which), and the program fields of other clients reach
the scheduler as marsched's own."""

from __future__ import annotations

import concurrent.futures
import json

import pytest

pytest.importorskip("vllm")
pytest.importorskip("httpx")
pytest.importorskip("all_minilm_l6_v2")

from marsched.metrics.trace import read_trace  # noqa: E402
from servers import Server, completion  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def server(chat_server):
    return chat_server


def state_of(server: Server, rid: str) -> dict:
    response = server.client.get(server.url + "/marsched/state", params={"request_id": rid})
    assert response.status_code == 200, response.text
    return response.json()["scheduler"]["request"]


def chat(server: Server, content: str, **fields) -> dict:
    return {"model": server.model, "messages": [{"role": "user", "content": content}], "max_tokens": 6, **fields}


def test_the_startup_line_says_every_request_is_predicted_in_the_api_server(server):
    assert "predictor learned (every request, in the API server)" in server.log.read_text()


@pytest.mark.parametrize("path, stream", [("/v1/chat/completions", False), ("/v1/chat/completions", True),
                                          ("/v1/completions", False)])
def test_a_request_without_a_prediction_is_ranked_by_the_api_servers(server, path, stream):
    body = (chat(server, "list the files in the current folder") if "chat" in path
            else completion(server, max_tokens=6))
    if stream:
        body["stream"] = True
    response = server.post(path, body)
    assert response.status_code == 200, response.text
    predicted = int(response.headers["x-marsched-predicted"])
    assert 1 <= predicted <= 6  # capped at max_tokens
    segment = state_of(server, response.headers["x-marsched-request-id"])["segments"][0]
    rid = response.headers["x-marsched-request-id"]
    predicts = [(e["output_tokens"], e["source"]) for e in read_trace(server.trace)
                if e.get("rid") == rid and e["event"] == "predict"]
    # The number follows the request: it ranks it if it comes before the request's admission; on
    # this idle server the request may be admitted first, and keeps its plan's length (max_tokens).
    if segment["prediction_source"] == "front-end":
        assert segment["predicted_output_tokens"] == predicted and predicts[-1] == (predicted, "front-end")
    else:
        assert segment["predicted_output_tokens"] == 6 and predicts == [(6, "plan")]


def test_a_stated_prediction_and_the_routers_program_fields_reach_the_scheduler(server):
    context = {"program_id": "router-prog-1", "expected_output_length": 3, "expected_resume": False}
    response = server.post("/v1/chat/completions", chat(server, "hi", vllm_xargs={"agentic_context": context}))
    assert response.status_code == 200, response.text
    assert "x-marsched-predicted" not in response.headers  # the client's number is used, not ours
    request = state_of(server, response.headers["x-marsched-request-id"])
    assert request["segments"][0]["predicted_output_tokens"] == 3
    bad = server.post("/v1/chat/completions", chat(server, "hi", vllm_xargs={"is_last_step": 7}))
    assert bad.status_code == 400 and "vllm_xargs.is_last_step" in bad.text


def test_concurrent_requests_are_all_predicted(server):
    def one(i: int) -> int:
        response = server.post("/v1/chat/completions", chat(server, f"question number {i} " * (1 + i % 5)))
        assert response.status_code == 200, response.text
        return int(response.headers["x-marsched-predicted"])

    before = server.state()["prediction"]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        predicted = list(pool.map(one, range(16)))
    assert all(1 <= p <= 6 for p in predicted)
    json.dumps(predicted)
    after = server.state()["prediction"]  # what predicting cost them, as /marsched/state shows it
    assert after["made"] >= before["made"] + 16 and after["failed"] == before["failed"]
    assert after["batches"] > before["batches"] and 1 <= after["batch_max"] <= 64
    assert 0 < after["wait_p50_ms"] <= after["wait_p99_ms"] <= after["wait_max_ms"]

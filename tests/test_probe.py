"""The probe (`marsched.experiments.probe`): its judgement of answers, its summary and command line,
and its short form: the fault mix for a while against the session's tools server (`servers.TOOLS`,
server tools that work, raise, time out, return non-strings and garbage), which must see no fault
and, once the clients' conversations are released, be back to holding nothing.
"""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from marsched.experiments.probe.actions import MIX, Outcome, Target, choose
from marsched.experiments.probe.fields import CHAT_PATH, COMPLETIONS_PATH, FIELDS, draw_fields, fuzz_body, verdict
from marsched.experiments.probe.load import summarize
from marsched.experiments.probe.run import healthy, leaks, parse, table


def error(code: int, message: str, param: str | None = None) -> str:
    return json.dumps({"error": {"message": message, "type": "BadRequestError", "param": param, "code": code}})


def test_a_2xx_is_fair_and_a_4xx_only_when_it_names_a_field_sent():
    assert verdict(200, '{"choices": []}', {"n": 2}).ok
    assert verdict(400, error(400, "seed is not supported", "seed"), {"seed": 7, "n": 1}).why == "4xx names seed"
    # the longer name wins: "top_logprobs" also contains "logprobs"
    assert verdict(400, error(400, "top_logprobs must be at most 20"), {"logprobs": True, "top_logprobs": 21}).why \
        == "4xx names top_logprobs"
    assert verdict(400, error(400, "Stream options can only be defined when `stream=True`."),
                   {"stream_options": {}}).why == "4xx names stream_options"
    unexplained = verdict(400, error(400, "something went wrong"), {"n": 2})
    assert not unexplained.ok and "names none of ['n']" in unexplained.why
    assert not verdict(500, error(500, "n is broken", "n"), {"n": 2}).ok  # a 5xx is a fault even if it names one
    assert not verdict(404, "not json", {"seed": 1}).ok
    assert verdict(422, "field required: max_tokens", {"max_tokens": "8"}).ok  # a body that is not JSON: its text


def test_a_streamed_refusal_is_judged_by_its_error_event():
    sent = {"stream": True, "response_format": {"type": "bogus"}}
    refused = 'data: {"error": {"message": "bad response_format", "code": 400}}\n\ndata: [DONE]\n'
    assert verdict(200, refused, sent).why == "4xx names response_format"
    broken = 'data: {"choices": []}\n\ndata: {"error": {"message": "engine dead", "code": 500}}\n'
    assert not verdict(200, broken, sent).ok
    assert verdict(200, 'data: {"choices": []}\n\ndata: [DONE]\n', sent).ok


def test_drawn_fields_belong_to_their_endpoint_and_repeat_with_the_seed():
    chat_only = {"tools", "tool_choice", "top_logprobs"}
    for seed in range(200):
        rng = random.Random(seed)
        for path in (CHAT_PATH, COMPLETIONS_PATH):
            fields = draw_fields(rng, path)
            assert 1 <= len(fields) <= 4 and set(fields) <= set(FIELDS)
            if path == COMPLETIONS_PATH:
                assert not chat_only & set(fields), fields
    assert fuzz_body(random.Random(3), "m") == fuzz_body(random.Random(3), "m")
    seen = set()
    rng = random.Random(0)
    for _ in range(500):
        seen |= set(fuzz_body(rng, "m")[1])
    assert set(FIELDS) <= seen  # every field is drawn


def test_the_mix_offers_server_tools_only_where_there_are_some():
    rng = random.Random(0)
    plain = {choose(rng, Target("u", "m", marsched=True)) for _ in range(2000)}
    assert plain == set(MIX) - {"server_tool"}
    assert "server_tool" in {choose(rng, Target("u", "m", marsched=True, server_tools=("t",))) for _ in range(500)}


def test_summary_counts_statuses_actions_and_faults():
    outcomes = [Outcome("plain", [200]), Outcome("fuzz", [400]), Outcome("conversation", [200, 503], fault="503: x"),
                Outcome("disconnect", [0], fault="ReadTimeout: ")]
    summary = summarize(outcomes)
    assert summary["statuses"] == {"2xx": 2, "4xx": 1, "5xx": 1, "no answer": 1}
    assert summary["requests"] == 5 and summary["actions_run"] == 4 and summary["faults"] == 2
    assert summary["by_action"]["conversation"] == {"runs": 1, "faults": 1}
    assert summary["first_faults"] == ["conversation: 503: x", "disconnect: ReadTimeout: "]


def test_a_run_is_healthy_only_without_faults_deaths_or_leftovers():
    left = {"alive": True, "health": True, "tracked": 0, "host_bytes": 0, "kv_cache_usage": 0.0}
    record = {"config": "mars", "summary": {"faults": 0, "statuses": {"2xx": 3}}, "after_idle": left, "rss": {}}
    assert healthy(record) and leaks(left) == {}
    assert not healthy({**record, "summary": {"faults": 1}})
    assert not healthy({**record, "after_idle": {**left, "alive": False}})
    assert not healthy({**record, "after_idle": {**left, "host_bytes": 4096}})
    assert leaks({**left, "retained_swap": 2}) == {"retained_swap": 2}
    assert "retained_swap 2" in table([{**record, "after_idle": {**left, "retained_swap": 2}}])
    assert not healthy({**record, "error": "server exited"})
    assert not healthy({**record, "died": "the server exited with status 1 during the load"})
    assert "mars (died)" in table([{**record, "died": "..."}])


def test_the_clients_stop_when_the_server_is_gone():
    from marsched.experiments.probe.load import run_clients

    calls = []

    def gone():
        calls.append(1)
        return len(calls) > 3  # each client's first look; then every later one says it died

    target = Target("http://127.0.0.1:9", "m", marsched=True)  # nothing listens: every action a fault
    outcomes = asyncio.run(run_clients(target, clients=3, duration_s=60, seed=0, server_gone=gone))
    assert len(outcomes) == 3 and all(o.fault for o in outcomes)


@pytest.mark.parametrize("argv, message", [
    (["--configs", "vllm,sglang"], "--configs: unknown sglang"),
    (["--clients", "0"], "--clients must be > 0"),
    (["--idle-s", "10", "--retention-limit-s", "30"], "--idle-s (10) must exceed --retention-limit-s (30)"),
    (["--out", "/dev/full"], "--out /dev/full: not a directory"),
    (["--out", "/proc/marsched-probe"], "--out /proc/marsched-probe: cannot create it"),
])
def test_the_command_line_refuses_what_cannot_run(argv, message, capsys, tmp_path):
    argv = [*argv, "--out", str(tmp_path / "out")] if "--out" not in argv else argv
    with pytest.raises(SystemExit) as stopped:
        parse(argv)
    assert stopped.value.code == 2 and message in capsys.readouterr().err


# --- the short form, live -----------------------------------------------------------------------

SHORT_S = 25.0
SERVER_TOOLS = ("weather", "boom", "slow", "number", "garbage")  # servers.TOOLS's, less the minute-long nap


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_short_soak_sees_no_fault_and_leaves_nothing_held(tools_server):
    pytest.importorskip("httpx")
    from servers import wait_idle

    from marsched.experiments.probe.load import run_clients

    target = Target(tools_server.url, tools_server.model, marsched=True, server_tools=SERVER_TOOLS)
    outcomes = asyncio.run(run_clients(target, clients=8, duration_s=SHORT_S, seed=0))
    summary = summarize(outcomes)
    print(json.dumps({k: v for k, v in summary.items() if k != "first_faults"}))
    assert summary["faults"] == 0, summary["first_faults"]
    assert summary["statuses"].get("5xx", 0) == 0 and "no answer" not in summary["statuses"]
    assert {"conversation", "disconnect", "fuzz"} <= set(summary["by_action"]), summary["by_action"]
    assert summary["statuses"].get("4xx", 0) > 0  # the malformed and oversized requests were refused
    # What the clients abandoned is kept until the server's retention limit (120 s here): release it.
    for cid in {o.conversation for o in outcomes if o.conversation}:
        assert tools_server.client.delete(f"{tools_server.url}/marsched/conversations/{cid}").status_code == 202
    wait_idle(tools_server, timeout_s=60)
    assert tools_server.client.get(tools_server.url + "/health").status_code == 200

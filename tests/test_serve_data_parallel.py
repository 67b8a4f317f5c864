"""`marsched serve` with vLLM's data parallelism (`--data-parallel-size 2`, two engine cores), live:

- every follow-up of concurrent multi-turn conversations runs on its first turn's rank and finds
  its KV kept there, and the conversations are spread over both ranks (`serve/affinity.py`);
- `/marsched/state` answers for each rank, and `/metrics` labels each rank's series;
- `DELETE /marsched/conversations/ID` frees the host copy on the rank that holds it;
- a turn that a stop string ended is kept on its rank (the mark goes with it, `abort_routing.py`);
- each rank writes a trace of its own (`trace.jsonl`, `trace.rank1.jsonl`), both end with `end`
  on SIGTERM, and each passes the audit on its own.

The tests run in order on one server; the last one stops it.
"""

from __future__ import annotations

import concurrent.futures
import json
import signal
import time

import pytest

pytest.importorskip("vllm")
openai = pytest.importorskip("openai")

from servers import DP_RETENTION_LIMIT_S as LIMIT_S  # noqa: E402
from servers import WEATHER, Server  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

QUESTION = " ".join(["what is the weather in paris today, and should I take an umbrella"] * 4)
CONVERSATIONS, TOOL_TURNS = 12, 2


@pytest.fixture(scope="module")
def server(dp_server):
    return dp_server


def meta(**fields) -> dict:
    return {"vllm_xargs": {"marsched": json.dumps(fields)}}


def ranks(server: Server) -> list[dict]:
    state = server.state()
    assert state["data_parallel_size"] == 2 and [r["rank"] for r in state["ranks"]] == [0, 1], state
    return state["ranks"]


def served_by(server: Server, rid: str) -> list[int]:
    from marsched.metrics.trace import read_trace

    traces = [server.trace, server.trace.with_name("trace.rank1.jsonl")]
    return [rank for rank, trace in enumerate(traces)
            if trace.exists() and any(e["event"] == "arrive" and e.get("rid") == rid for e in read_trace(trace))]


def tool_turn(client, model: str, messages: list, conversation: str, rid: str, **fields) -> list:
    response = client.chat.completions.create(
        model=model, messages=messages, tools=[WEATHER], temperature=0, max_tokens=40,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        extra_body=meta(conversation=conversation, rid=rid, **fields))
    message = response.choices[0].message
    return messages + [message.model_dump(exclude_none=True),
                       {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "rain, 12 degrees"}]


def conversation(server: Server, index: int) -> str:
    name = f"dp-conversation-{index}"
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
        messages = [{"role": "user", "content": f"{name} {QUESTION}"}]
        for turn in range(TOOL_TURNS):
            messages = tool_turn(client, server.model, messages, name, f"{name}-t{turn}", tool_s=0.3)
            time.sleep(0.3)  # the client's tool
        client.chat.completions.create(model=server.model, messages=messages, temperature=0, max_tokens=8,
                                       extra_body=meta(conversation=name, retain=False, rid=f"{name}-answer"))
    return name


def wait_for(check, what: str, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what} never happened"
        time.sleep(0.1)


def test_follow_ups_run_where_their_conversation_is_kept(server):
    before = [r["scheduler"] for r in ranks(server)]
    with concurrent.futures.ThreadPoolExecutor(CONVERSATIONS // 2) as pool:  # two rounds of concurrent ones
        names = list(pool.map(lambda i: conversation(server, i), range(CONVERSATIONS)))
    on = {}
    for name in names:
        turns = [served_by(server, f"{name}-t{t}") for t in range(TOOL_TURNS)] + [served_by(server, f"{name}-answer")]
        assert all(len(t) == 1 for t in turns) and len({t[0] for t in turns}) == 1, (name, turns)
        on[name] = turns[0][0]
    assert set(on.values()) == {0, 1}, f"every conversation went to one rank: {on}"
    after = [r["scheduler"] for r in ranks(server)]
    for rank in (0, 1):
        hits = after[rank]["retention_hits"] - before[rank]["retention_hits"]
        misses = after[rank]["retention_misses"] - before[rank]["retention_misses"]
        follow_ups = TOOL_TURNS * sum(r == rank for r in on.values())
        assert (hits, misses) == (follow_ups, 0), (rank, hits, misses, on)
    affinity = server.state()["affinity"]
    assert affinity["placement"] == "least-loaded" and sum(affinity["placed_by_rank"]) >= CONVERSATIONS
    assert affinity["conversations"] == 0  # each ended with retain: false


def test_metrics_label_each_ranks_series(server):
    from prometheus_client.parser import text_string_to_metric_families

    text = server.client.get(server.url + "/metrics").text
    values = {(s.name, tuple(sorted(s.labels.items()))): s.value
              for family in text_string_to_metric_families(text) for s in family.samples}
    for rank, state in enumerate(ranks(server)):
        label = (("rank", str(rank)),)
        assert values[("marsched_state_up", label)] == 1
        assert values[("marsched_retention_hits_total", label)] == state["scheduler"]["retention_hits"] > 0
        assert values[("marsched_device_total_blocks", label)] == state["scheduler"]["device_total_blocks"]


def test_a_release_frees_the_host_copy_on_its_rank(server):
    name = "dp-released"
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
        tool_turn(client, server.model, [{"role": "user", "content": f"{name} {QUESTION}"}], name, f"{name}-t0",
                  strategy="swap")
    (rank,) = served_by(server, f"{name}-t0")
    wait_for(lambda: ranks(server)[rank]["host_bytes"] > 0, "the swap copy")
    assert ranks(server)[1 - rank]["host_bytes"] == 0
    released = ranks(server)[rank]["scheduler"]["retention_released"]
    response = server.client.delete(server.url + f"/marsched/conversations/{name}")
    assert response.status_code == 202, response.text
    wait_for(lambda: ranks(server)[rank]["host_bytes"] == 0, "the host copy freed on its rank")
    wait_for(lambda: ranks(server)[rank]["scheduler"]["retention_released"] == released + 1, "the release counted")


def test_a_turn_a_stop_string_ended_is_kept_on_its_rank(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
        messages = [{"role": "user", "content": f"dp-stop {QUESTION}"}]
        text = client.chat.completions.create(model=server.model, messages=messages, temperature=0, max_tokens=16,
                                              extra_body={"cache_salt": "dp-stop-probe"}).choices[0].message.content
        stop = text[len(text) // 2:len(text) // 2 + 3]
        assert stop.strip() and len(text) > 8, f"the model wrote too little to stop on: {text!r}"
        stopped = client.chat.completions.create(
            model=server.model, messages=messages, temperature=0, max_tokens=16, stop=[stop],
            extra_body=meta(conversation="dp-stop", strategy="preserve", rid="dp-stop-turn"))
    assert stopped.choices[0].finish_reason == "stop"
    (rank,) = served_by(server, "dp-stop-turn")
    wait_for(lambda: ranks(server)[rank]["scheduler"]["retained_preserve"] == 1, "the stopped turn kept")
    assert server.client.delete(server.url + "/marsched/conversations/dp-stop").status_code == 202
    wait_for(lambda: ranks(server)[rank]["scheduler"]["retained_preserve"] == 0, "the release")


def test_retentions_that_end_on_idle_ranks_are_all_shown_freed(server):
    # Turns kept moments apart end moments apart: each ending wakes its idle rank for one step,
    # too soon after the last for the periodic publish, so the ending itself must publish.
    import threading

    names = [f"dp-abandoned-{i}" for i in range(4)]

    def abandoned(name: str) -> None:
        with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
            tool_turn(client, server.model, [{"role": "user", "content": f"{name} {QUESTION}"}], name, f"{name}-t0",
                      strategy="swap")

    threads = [threading.Thread(target=abandoned, args=(name,)) for name in names]
    for thread in threads:
        thread.start()
        time.sleep(0.15)
    for thread in threads:
        thread.join()
    kept_t = time.monotonic()
    wait_for(lambda: sum(r["scheduler"]["retained_swap"] for r in ranks(server)) == 4, "four kept turns")
    time.sleep(max(kept_t + LIMIT_S + 3 - time.monotonic(), 0))
    for rank in ranks(server):
        held = {k: v for k, v in rank["scheduler"].items() if k.startswith("retained_") and v}
        assert not held and rank["host_bytes"] == 0, (rank["rank"], held, rank["host_bytes"])


@pytest.mark.stops_shared
def test_each_rank_writes_its_own_complete_trace(server):
    from marsched.audit import audit_trace
    from marsched.metrics.trace import read_trace

    server.stop(signal.SIGTERM)
    assert server.process.returncode == 0, server.log.read_text()[-3000:]
    finished = 0
    for trace in (server.trace, server.trace.with_name("trace.rank1.jsonl")):
        events = read_trace(trace)
        assert [e["event"] for e in events[:1]] == ["run"] and events[-1]["event"] == "end", trace
        finished += sum(e["event"] == "finish" for e in events)
        result = audit_trace(trace)
        assert result.clean, "\n".join(map(str, result.violations))
    assert finished >= CONVERSATIONS * (TOOL_TURNS + 1) + 3

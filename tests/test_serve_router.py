"""Two `marsched serve` replicas behind vllm-project/router (the real one, `vllm-router` from
PyPI) with its `consistent_hash` policy: a conversation whose turns carry `X-Session-ID` stays on
one replica, so its follow-up finds the KV that replica kept.

The replicas are the session's two shared servers (`servers.CHAT` and `servers.TOOLS`, the same
model and chat template); each check is on the counters' change and on the test's own request
ids in each replica's trace.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request

import pytest

pytest.importorskip("vllm")
openai = pytest.importorskip("openai")

from servers import WEATHER  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

ROUTER = shutil.which("vllm-router", path=os.path.dirname(sys.executable))
QUESTION = " ".join(["what is the weather in paris today, and should I take an umbrella"] * 4)


@pytest.fixture(scope="module")
def router(chat_server, tools_server, tmp_path_factory):
    if ROUTER is None:
        pytest.skip("vllm-router is not installed (the vllm extra installs it on x86-64)")
    from marsched.serve.launch import free_port, stop_process_group

    replicas = {chat_server.url: chat_server, tools_server.url: tools_server}
    port = free_port("127.0.0.1")
    log = tmp_path_factory.mktemp("router") / "router.log"
    with open(log, "w") as out:
        process = subprocess.Popen(
            [ROUTER, "--worker-urls", *replicas, "--policy", "consistent_hash", "--host", "127.0.0.1",
             "--port", str(port), "--prometheus-port", str(free_port("127.0.0.1"))],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, log.read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, f"the router never became healthy:\n{log.read_text()[-3000:]}"
            time.sleep(0.2)
        yield url, replicas
    finally:
        stop_process_group(process, grace_s=10)


def _served_by(replicas: dict, rid: str) -> list[str]:
    """The replicas whose trace has the request `rid`."""
    from marsched.metrics.trace import read_trace

    return [replica_url for replica_url, server in replicas.items()
            if any(e["event"] == "arrive" and e.get("rid") == rid for e in read_trace(server.trace))]


def _meta(**fields) -> dict:
    return {"vllm_xargs": {"marsched": json.dumps(fields)}}


def test_a_conversation_stays_on_its_replica_and_reuses_its_kv(router):
    url, replicas = router
    model = next(iter(replicas.values())).model  # both serve the same model
    before = {u: s.state()["scheduler"]["retention_hits"] for u, s in replicas.items()}
    conversations: dict[str, list[str]] = {u: [] for u in replicas}
    for index in range(16):  # until both replicas have had a conversation (the hash decides which)
        if all(len(c) >= 1 for c in conversations.values()) and index >= 4:
            break
        session = f"router-conversation-{index}"
        with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120,
                           default_headers={"X-Session-ID": session}) as client:
            messages = [{"role": "user", "content": f"{session} {QUESTION}"}]
            first = client.chat.completions.create(
                model=model, messages=messages, tools=[WEATHER], temperature=0,
                max_tokens=40, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                extra_body=_meta(conversation=session, strategy="preserve", rid=f"{session}-t1"))
            call = first.choices[0].message.tool_calls[0]
            messages += [first.choices[0].message.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": call.id, "content": "rain, 12 degrees"}]
            client.chat.completions.create(
                model=model, messages=messages, temperature=0, max_tokens=8,
                extra_body=_meta(conversation=session, retain=False, rid=f"{session}-t2"))
        first_on, follow_up_on = _served_by(replicas, f"{session}-t1"), _served_by(replicas, f"{session}-t2")
        assert len(first_on) == 1 and follow_up_on == first_on, (session, first_on, follow_up_on)
        conversations[first_on[0]].append(session)
    assert all(conversations.values()), f"every conversation went to one replica: {conversations}"
    for replica_url, server in replicas.items():  # each follow-up found its turn kept where it ran
        hits = server.state()["scheduler"]["retention_hits"] - before[replica_url]
        assert hits == len(conversations[replica_url]), (replica_url, hits, conversations)

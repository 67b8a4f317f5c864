"""mars-boost, mars-boost-label and autellix through a live `marsched serve`: a conversation's turns as one program.

Each server is started with the policy (tiny model, CPU) and sent conversations of plain
completions naming their `conversation`; the scheduler's event trace shows what each turn
ranked by. `--policy mars-boost` ranks a later turn by its program's first arrival (a large γ
makes the order first come first served by that arrival, so the key is that arrival, less a
few milliseconds), and so does `--policy mars-boost-label`, whose boost learns from the turns that
ended; `--policy infercept` queues it first come first served by that arrival; `--policy
autellix` by the service its program attained over its earlier turns, counted in the steps each
turn ran in.
"""

from __future__ import annotations

import signal
import time

import pytest

pytest.importorskip("vllm")

from servers import Server, completion, marsched  # noqa: E402

from marsched.metrics.trace import read_trace  # noqa: E402
from marsched.policy.plas import LEVEL_SPAN_S, level_of  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

REPLY_TOKENS = 8
GAMMA = 1000.0  # per device second: a boost of milliseconds at these sizes
POLICIES = {"mars-boost": ("--boost-gamma", str(GAMMA)), "mars-boost-label": ("--boost-gamma", str(GAMMA)),
            "autellix": (), "infercept": ()}


@pytest.fixture(scope="module")
def servers(tiny_model, tmp_path_factory):
    """One server per policy, started side by side."""
    running = {policy: Server(tiny_model, tmp_path_factory.mktemp(policy),
                              serve_args=("--policy", policy, "--predictor", "oracle", *extra))
               for policy, extra in POLICIES.items()}
    try:
        for server in running.values():
            server.wait_ready()
        yield running
    finally:
        for server in running.values():
            server.close()


def turn(server: Server, conversation: str, rid: str, text: str) -> str:
    body = completion(server, prompt=text, max_tokens=REPLY_TOKENS, ignore_eos=True, temperature=0,
                      **marsched(conversation=conversation, rid=rid))
    response = server.post("/v1/completions", body)
    assert response.status_code == 200, response.text
    return text + response.json()["choices"][0]["text"]


def events(server: Server, kind: str) -> dict[str, dict]:
    return {e["rid"]: e for e in read_trace(server.trace) if e["event"] == kind}


@pytest.mark.parametrize("policy", ["mars-boost", "mars-boost-label"])
def test_mars_boost_ranks_a_later_turn_by_its_programs_first_arrival(servers, policy):
    server = servers[policy]
    old = turn(server, "old", "old-1", "the quick brown fox jumps over the lazy dog")
    time.sleep(0.5)
    turn(server, "new", "new-1", "a different conversation starts here")
    turn(server, "old", "old-2", old + " and then")
    arrive, admit = events(server, "arrive"), events(server, "admit")
    first = arrive["old-1"]["arrival_s"]
    assert arrive["old-2"]["arrival_s"] - first > 0.5
    assert arrive["old-2"]["program_arrival_s"] == pytest.approx(first, abs=1e-5)
    assert "program_arrival_s" not in arrive["old-1"] and "program_arrival_s" not in arrive["new-1"]
    # Boost's key: the arrival it ranks by, less the boost (milliseconds here).
    for rid, arrival in (("old-1", first), ("new-1", arrive["new-1"]["arrival_s"]), ("old-2", first)):
        assert arrival - 0.05 < admit[rid]["score"] < arrival, rid


def test_infercept_queues_a_later_turn_by_its_programs_first_arrival(servers):
    # First come first served by the arrival a simulated request keeps across its calls.
    server = servers["infercept"]
    old = turn(server, "old", "old-1", "the quick brown fox jumps over the lazy dog")
    time.sleep(0.5)
    turn(server, "old", "old-2", old + " and then")
    arrive, admit = events(server, "arrive"), events(server, "admit")
    first = arrive["old-1"]["arrival_s"]
    assert arrive["old-2"]["arrival_s"] - first > 0.5
    assert arrive["old-2"]["program_arrival_s"] == pytest.approx(first, abs=1e-5)
    assert admit["old-2"]["score"] == pytest.approx(first, abs=1e-5)


def test_autellix_counts_a_programs_service_across_its_turns(servers):
    server = servers["autellix"]
    text = turn(server, "a", "a-1", "the quick brown fox jumps over the lazy dog")
    turn(server, "b", "b-1", "a different conversation starts here")
    text = turn(server, "a", "a-2", text + " and then")
    turn(server, "a", "a-3", text + " and again")
    arrive, admit = events(server, "arrive"), events(server, "admit")
    # One iteration per step a turn ran in: a prefill that makes the first token, then a decode per token.
    assert [arrive[rid].get("attained", 0) for rid in ("a-1", "b-1", "a-2", "a-3")] == \
        [0, 0, REPLY_TOKENS, 2 * REPLY_TOKENS]
    for rid in ("a-1", "b-1", "a-2", "a-3"):  # PLAS: the queue of the program's service, then the turn's arrival
        level = level_of(arrive[rid].get("attained", 0), 0)
        assert admit[rid]["score"] == pytest.approx(level * LEVEL_SPAN_S + arrive[rid]["arrival_s"], abs=1e-3), rid
    assert level_of(2 * REPLY_TOKENS, 0) > level_of(REPLY_TOKENS, 0) > 0


def test_the_traces_pass_the_audit_and_the_schema(servers):
    """Stopped as a supervisor stops them (this module's last test): each trace is complete, its
    events valid against the schema, and `marsched audit` finds nothing."""
    from test_trace_schema import schema_errors

    from marsched.audit import audit_trace

    for policy, server in servers.items():
        server.stop(signal.SIGTERM)
        assert server.process.returncode == 0, server.log.read_text()[-3000:]
        trace = read_trace(server.trace)
        assert trace[0]["policy"]["name"] == policy and trace[-1]["event"] == "end"
        assert schema_errors(trace) == []
        result = audit_trace(server.trace)
        assert result.clean, [v.message for v in result.violations]

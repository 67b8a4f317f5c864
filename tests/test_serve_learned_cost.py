"""`marsched serve` learns its cost model from its own steps and copies, and shows it in `/marsched/state`.

On the session's chat server (`servers.CHAT`, the tiny model, no profile and no cost constants
given): after a few completions the iteration terms are learned, and after a conversation turn
kept as Swap the host link's rate is too. The bounds are wide on purpose: they say the numbers
are this engine's (not the placeholders) and sane, whatever the machine's speed.
"""

from __future__ import annotations

import time

import pytest

pytest.importorskip("vllm")

from servers import Server, completion, marsched  # noqa: E402

PLACEHOLDER_STEP = (2e-5, 0.01)  # seconds per token, per iteration (`CostSettings`)
PLACEHOLDER_SWAP = 1e6


def cost_model(server: Server) -> dict:
    return server.state()["scheduler"]["cost_model"]


def wait_for(server: Server, check, what: str, timeout_s: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        cost = cost_model(server)
        if check(cost):
            return cost
        assert time.monotonic() < deadline, f"no {what} after {timeout_s} s: {cost}"
        time.sleep(0.3)


def test_serve_learns_the_step_terms_and_the_swap_rate(chat_server):
    server = chat_server
    first = cost_model(server)
    assert first["min_steps"] >= 1 and first["step_source"] in ("placeholder", "learned")
    # Prefills of several sizes and decode steps: more steps than the fit needs before it replaces the prior.
    for words in (2, 20, 60):  # about 3 tokens a word: 6 to 180 tokens of the 512 the server takes
        response = server.post("/v1/completions", completion(server, prompt="word " * words, max_tokens=24,
                                                              ignore_eos=True))
        assert response.status_code == 200, response.text
    learned = wait_for(server, lambda c: c["step_source"] == "learned", "learned step terms")
    assert learned["steps"] >= max(learned["min_steps"], first["steps"] + 3 * 24)
    terms = [learned[k] for k in ("seconds_per_iteration", "seconds_per_token", "seconds_per_context_token",
                                  "seconds_per_sequence", "seconds_per_attention_pair")]
    assert all(t >= 0 for t in terms)
    assert (learned["seconds_per_token"], learned["seconds_per_iteration"]) != PLACEHOLDER_STEP
    one_token_step = learned["seconds_per_iteration"] + learned["seconds_per_token"] + learned["seconds_per_sequence"]
    assert 1e-5 < one_token_step < 10.0  # a decode step of the tiny model on a CPU, on any machine

    # A turn kept as Swap: its blocks are copied to the host, measured in the worker, told to the scheduler.
    response = server.post("/v1/completions", completion(
        server, prompt="swap " + "word " * 60, max_tokens=4, **marsched(conversation="learned-cost-swap", strategy="swap",
                                                               tool_s=30.0)))
    assert response.status_code == 200, response.text
    swapped = wait_for(server, lambda c: c["swap_source"] == "learned", "learned swap rate")
    assert swapped["swap_blocks"] >= 4 and swapped["swap_seconds"] > 0
    assert swapped["swap_tokens_per_s"] != PLACEHOLDER_SWAP and swapped["swap_tokens_per_s"] > 0
    assert server.client.delete(server.url + "/marsched/conversations/learned-cost-swap").status_code == 202

    # The keys computed with the learned model are the policy's: the audit recomputes each admitted
    # request's from its trace (the server runs on, so only the order is checked, not the lifecycles).
    from marsched.audit import audit_trace
    from marsched.audit.violations import Check
    from marsched.metrics.trace import read_trace

    assert any("cost" in (e.get("key_basis") or {}) for e in read_trace(server.trace) if e["event"] == "admit")
    result = audit_trace(server.trace)
    # Only the key checks: the shared server's trace also holds other tests' requests, whose lifecycles
    # are not this test's (the stopping test audits the whole trace).
    keys = [v for v in result.violations if v.check is Check.ORDER and ("key" in v.message or "score" in v.message)]
    assert not keys, keys[:5]

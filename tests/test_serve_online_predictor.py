"""`marsched serve --predictor online` learns reply lengths from the requests it served.

The live policy reads each request's plan (what its client declared: for a plain completion, one
segment of `max_tokens`), so its online predictor once learned nothing and predicted its prior
for ever; and a conversation's first turn priced its program's turns to come at `max_tokens`.
Here a server is sent plain completions of a few tokens each, then a conversation's first turn
with a large `max_tokens`: the trace shows the predictions it ranked them by.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from servers import Server, completion, marsched  # noqa: E402

from marsched.metrics.trace import read_trace  # noqa: E402
from marsched.predict.online import PRIOR_TOKENS  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

REPLY_TOKENS = 6  # what every reply generates (ignore_eos)
MAX_TOKENS = 300  # what the later requests allow: their plan


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    running = Server(tiny_model, tmp_path_factory.mktemp("online"),
                     serve_args=("--policy", "mars", "--predictor", "online"))
    try:
        running.wait_ready()
        yield running
    finally:
        running.close()


def send(server: Server, rid: str, max_tokens: int, **fields) -> None:
    body = completion(server, prompt=f"request {rid} asks for a reply", max_tokens=max_tokens, ignore_eos=True,
                      temperature=0, **marsched(rid=rid, **fields))
    response = server.post("/v1/completions", body)
    assert response.status_code == 200, response.text


def test_predictions_learn_the_replies_served_and_a_first_turns_outlook_uses_them(server):
    for k in range(3):
        send(server, f"short-{k}", REPLY_TOKENS)
    send(server, "first-turn", MAX_TOKENS, conversation="c1")  # generates MAX_TOKENS: sent last
    trace = read_trace(server.trace)
    predicted = {e["rid"]: e["output_tokens"] for e in trace if e["event"] == "predict"}
    assert predicted["short-0"] == PRIOR_TOKENS  # nothing served yet
    assert predicted["short-2"] == REPLY_TOKENS  # the replies served, not the prior for ever
    assert predicted["first-turn"] == REPLY_TOKENS  # not its plan, max_tokens
    admit = next(e for e in trace if e["event"] == "admit" and e["rid"] == "first-turn")
    # Its program's outlook prices each turn to come at the predicted reply, not at max_tokens.
    assert admit["key_basis"]["program"][1] == REPLY_TOKENS

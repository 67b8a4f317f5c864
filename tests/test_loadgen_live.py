"""`marsched loadgen` against a live `marsched serve --bench-reply-lengths` (tiny model, CPU):

- a short claude-code replay: every turn finishes, every reply ends exactly at the trace's
  length (scaled), with finish reason `stop`; the JSON report's numbers are consistent;
- the scheduler never saw the lengths: its event trace's predicted output of every turn is the
  fixed `max_tokens` cap (the oracle predictor takes the plan as the truth, so any length it
  had been told would show here);
- a short agent-text replay (real text, the multi-agent sessions' first turns fit the tiny
  model's context): the same, on real prompts.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("vllm")
pytest.importorskip("openai")

from servers import Server  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

MAX_TOKENS = 1024  # the cap every turn sends; the tiny model's context is 4096
PROBE_MAX_TOKENS = 12  # marsched.loadgen.client's probe turn


@pytest.fixture(scope="module")
def server(loadgen_server):
    return loadgen_server


def loadgen(server: Server, out, *args: str) -> dict:
    run = subprocess.run([sys.executable, "-m", "marsched.cli", "loadgen", server.url, "--max-tokens",
                          str(MAX_TOKENS), "--out", str(out), *args], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr + run.stdout
    assert "warning" not in run.stderr, run.stderr  # the probe found the lengths forced
    return json.loads(out.read_text())


def check_every_reply_has_its_length(report: dict) -> list[dict]:
    assert report["server"]["reply_lengths_forced"] is True and report["interrupted"] is False
    turns = [t for c in report["records"] for t in c["turns"]]
    assert turns and report["turns"]["failed"] == 0 and report["errors"] == {}
    for turn in turns:
        assert turn["completion_tokens"] == turn["target_tokens"] and turn["finish_reason"] == "stop", turn
    summary = report["turns"]
    assert summary["finished"] == summary["sent"] == summary["exact_length"] == len(turns)
    assert summary["output_tokens"] == sum(t["target_tokens"] for t in turns)
    conversations = report["conversations"]
    assert conversations["finished"] == conversations["started"] == len(report["records"]) > 0
    assert summary["e2e_p50_s"] <= summary["e2e_p99_s"] and summary["per_s"] > 0
    return turns


def test_a_claude_code_replay_gets_the_traces_reply_lengths(server, tmp_path):
    report = loadgen(server, tmp_path / "cc.json", "--workload", "claude-code", "--token-scale", "0.01",
                     "--rate", "0.5", "--duration", "12", "--max-turns", "4", "--max-gap-s", "1", "--seed", "0",
                     "--plot", str(tmp_path / "cc.png"))
    turns = check_every_reply_has_its_length(report)
    assert report["turns"]["followups"] > 0 and report["turns"]["followup_ttft_p99_s"] is not None
    assert len({t["target_tokens"] for t in turns}) > 3  # the trace's lengths, not one constant
    assert (tmp_path / "cc.png").read_bytes()[:4] == b"\x89PNG"


def test_the_scheduler_never_saw_a_reply_length(server):
    events = [json.loads(line) for line in server.trace.read_text().splitlines()]
    predicted = [e["output_tokens"] for e in events if e["event"] == "predict"]
    assert len(predicted) > 10
    assert set(predicted) <= {MAX_TOKENS, PROBE_MAX_TOKENS}, sorted(set(predicted))


def test_an_agent_text_replay_gets_the_traces_reply_lengths(server, tmp_path):
    report = loadgen(server, tmp_path / "at.json", "--workload", "agent-text:magagent", "--rate", "0.5",
                     "--duration", "6", "--max-turns", "2", "--max-gap-s", "1", "--seed", "1")
    turns = check_every_reply_has_its_length(report)
    assert all(t["prompt_tokens"] > 500 for t in turns)  # the sessions' real prompts

"""Claude Code, unmodified, against `marsched serve`: its own tool loop, its follow-ups kept.

The real CLI (npm `@anthropic-ai/claude-code`, pointed at the server by `ANTHROPIC_BASE_URL`, with
non-essential traffic off) runs `claude -p` in a folder holding one file. The model is the one
`marsched model` builds, with a long context (Claude Code sends about 8,000 prompt tokens), and the
bench-only scripted replies (`marsched.loadgen.scripted_reply`) make it answer as a model that
uses tools would: a `tool_use` of `Bash` running `ls`, then, once the prompt holds its result, an
answer. Claude Code runs `ls` itself and sends the follow-up; nothing of ours is in its requests.

Each run must end by itself (exit 0, the answer printed), its requests must arrive as one inferred
program in the trace, and >= 95% of its follow-ups must be retention hits by `/metrics`.

Skipped where the CLI is not installed (`npm install -g @anthropic-ai/claude-code@2.1.332`; the
npm registry is reachable from CI).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time

import pytest

pytest.importorskip("vllm")

from servers import started  # noqa: E402
from test_serve_unmodified_clients import HIT_SHARE, counters, trace_length  # noqa: E402

CLAUDE = shutil.which("claude")
pytestmark = [
    pytest.mark.vllm, pytest.mark.timeout(900),
    pytest.mark.skipif(CLAUDE is None, reason="Claude Code is not installed "
                       "(npm install -g @anthropic-ai/claude-code@2.1.332 puts `claude` on PATH)"),
]

RUNS = 3
SCRIPT = {"turn_marker": "<tool> ", "replies": ["[Bash(command='ls')]", "The files are listed above."]}
CLI_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from marsched.bench.model import CHAT_TEMPLATE, ModelShape, build_model
    from marsched.loadgen.scripted_reply import PROCESSOR, SCRIPT_ENV

    folder = tmp_path_factory.mktemp("claude-code")
    model = folder / "model"
    build_model(model, ModelShape(layers=2, hidden=128, heads=4, kv_heads=2, intermediate=256, max_position=32768,
                                  dtype="float32"))
    script = folder / "script.json"
    script.write_text(json.dumps(SCRIPT))
    with started(str(model), folder, template=CHAT_TEMPLATE, serve_args=("--retention-limit-s", "120"),
                 vllm_args=("--max-model-len", "32768", "--block-size", "32", "--logits-processors", PROCESSOR),
                 env={SCRIPT_ENV: str(script)}) as running:
        yield running


def claude(server, folder) -> subprocess.CompletedProcess:
    """`claude -p` as docs/clients.md runs it, in a folder of its own with a home of its own."""
    work, home = folder / "work", folder / "home"
    work.mkdir(parents=True)
    home.mkdir(parents=True)
    (work / "notes.txt").write_text("a file to list\n")
    env = {**os.environ, "HOME": str(home), "ANTHROPIC_BASE_URL": server.url, "ANTHROPIC_API_KEY": "dummy",
           "ANTHROPIC_MODEL": server.model, "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
           "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "64"}
    return subprocess.run([CLAUDE, "-p", "list the files in this directory", "--allowedTools", "Bash(ls)",
                           "--output-format", "stream-json", "--verbose"],
                          cwd=work, env=env, capture_output=True, text=True, timeout=CLI_TIMEOUT_S,
                          stdin=subprocess.DEVNULL)


def arrivals_after(server, start: int, timeout_s: float = 20.0) -> list[dict]:
    """The `arrive` events after line `start`, once every request that arrived has been written."""
    deadline = time.monotonic() + timeout_s
    while True:
        events = [json.loads(line) for line in server.trace.read_text().splitlines()[start:] if line.strip()]
        arrive = [e for e in events if e["event"] == "arrive"]
        finished = sum(e["event"] == "finish" for e in events)
        if (arrive and finished >= len(arrive)) or time.monotonic() > deadline:
            return arrive
        time.sleep(0.2)


def test_claude_codes_tool_loop_is_one_program_and_its_follow_ups_are_kept(server, tmp_path):
    before = counters(server)
    follow_ups = 0
    for run in range(RUNS):
        start = trace_length(server)
        result = claude(server, tmp_path / f"run{run}")
        steps = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
        assert result.returncode == 0, (result.returncode, result.stdout[-3000:], result.stderr[-3000:])
        text = json.dumps(steps)
        assert '"name": "Bash"' in text and "notes.txt" in text, text[-3000:]  # it ran ls and read the result
        assert steps[-1].get("result") == SCRIPT["replies"][1], steps[-1]
        arrive = arrivals_after(server, start)
        programs = {e["program"] for e in arrive}
        assert len(programs) == 1 and {e["identity"] for e in arrive} == {"inferred"}, arrive
        assert len(arrive) >= 2 and all("carried" in e for e in arrive[1:]), arrive
        follow_ups += len(arrive) - 1
    after = counters(server)
    delta = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in after}
    assert delta["marsched_follow_ups_matched_total"] == follow_ups, delta
    assert delta["marsched_retention_hits_total"] >= HIT_SHARE * follow_ups, delta
    print({"runs": RUNS, "follow_ups": follow_ups, "hits": delta["marsched_retention_hits_total"],
           "misses": delta["marsched_retention_misses_total"]})

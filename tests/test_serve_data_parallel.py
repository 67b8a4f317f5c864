"""`marsched serve` with vLLM's data parallelism (two engine cores): each rank writes a trace of
its own (`trace.jsonl`, `trace.rank1.jsonl`), both end with `end` on SIGTERM, and each passes
the audit on its own (one file for both interleaves two runs, which the audit refuses)."""

from __future__ import annotations

import signal

import pytest

pytest.importorskip("vllm")

from servers import Server, completion  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]


def test_each_rank_writes_its_own_complete_trace(tiny_model, tmp_path):
    from marsched.audit import audit_trace
    from marsched.metrics.trace import read_trace

    server = Server(tiny_model, tmp_path, vllm_args=("--data-parallel-size", "2"))
    try:
        server.wait_ready()
        for index in range(6):  # vLLM's balancer spreads them over both ranks
            response = server.post("/v1/completions", completion(server, max_tokens=4))
            assert response.status_code == 200, response.text
        server.stop(signal.SIGTERM)
        assert server.process.returncode == 0, server.log.read_text()[-3000:]
    finally:
        server.kill_leftovers()
    traces = [server.trace, server.trace.with_name("trace.rank1.jsonl")]
    finished = 0
    for trace in traces:
        events = read_trace(trace)
        assert [e["event"] for e in events[:1]] == ["run"] and events[-1]["event"] == "end", trace
        finished += sum(e["event"] == "finish" for e in events)
        result = audit_trace(trace)
        assert result.clean, "\n".join(map(str, result.violations))
    assert finished == 6

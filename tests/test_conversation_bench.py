"""scripts/conversation_bench.py (marsched.experiments.conversations) without servers: the load, the
commands, the summary and the table.

The servers themselves are exercised by running the script (`--quick`); here: every
configuration gets the same conversations and the same engine options, the marsched keys
follow the protocol, and the numbers in the table are the ones in the records.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace

import pytest

from marsched.experiments.conversations import client, load as loads, report, servers

WORDS = [f"w{chr(97 + i)}{chr(97 + j)}" for i in range(26) for j in range(26)]


def test_the_load_is_drawn_from_the_seed_alone():
    load = loads.Load(rate=2.0, duration_s=30.0, prompt_tokens=50, tool_turns=3, result_tokens=7, seed=3)
    first, again = loads.draw_load(load, WORDS), loads.draw_load(load, WORDS)
    assert first == again and len(first) > 20
    assert first != loads.draw_load(replace(load, seed=4), WORDS)
    assert all(0 < c.arrival_s < 30 for c in first) and [c.arrival_s for c in first] == sorted(c.arrival_s for c in first)
    conv = first[0]
    assert len(conv.prompt.split()) == 50 and len(conv.tool_s) == 3 and len(conv.results) == 3
    assert all(len(r.split()) == 7 for r in conv.results)
    tool_times = sorted(t for c in loads.draw_load(replace(load, duration_s=600), WORDS) for t in c.tool_s)
    assert 1.2 < tool_times[len(tool_times) // 2] < 1.8  # median ~ tool_median_s (1.5)


def test_every_turn_names_its_conversation_and_only_the_last_stops_retention():
    load = loads.Load(tool_median_s=2.5)
    middle = json.loads(loads.marsched_xargs(load, "c1", last=False)["marsched"])
    last = json.loads(loads.marsched_xargs(load, "c1", last=True)["marsched"])
    assert middle == {"conversation": "c1", "tool_s": 2.5}  # the client's estimate, not the draw
    assert last == {"conversation": "c1", "retain": False}
    assert loads.marsched_xargs(replace(load, conversation_keys=False), "c1", last=False) is None


def test_the_configurations_differ_only_in_server_and_retention(tmp_path):
    engine = servers.Engine(model="/m", kv_blocks=77, fixed_s=None, extra=("--dtype", "float32"))
    load = loads.Load(tool_median_s=1.5, seed=9)
    commands = {c: servers.server_command(c, engine, load, 8000, tmp_path / "t.jinja") for c in servers.CONFIGS}

    def vllm_part(command):
        return command[command.index("--max-model-len"):]

    assert vllm_part(commands["vllm"]) == vllm_part(commands["mars"]) == vllm_part(commands["fixed"])
    shared = vllm_part(commands["vllm"])
    for option in ("--enable-prefix-caching", "--enable-auto-tool-choice", "--dtype"):
        assert option in shared
    assert shared[shared.index("--num-gpu-blocks-override") + 1] == "77"
    assert shared[shared.index("--seed") + 1] == "9"
    assert "marsched.cli" not in commands["vllm"] and "--retention" not in commands["vllm"]
    mars, fixed = commands["mars"], commands["fixed"]
    assert mars[mars.index("--retention") + 1] == "policy"
    assert fixed[fixed.index("--retention") + 1] == "fixed:3"  # 2 x the median tool time
    assert servers.server_command("fixed", replace(engine, fixed_s=4.5), load, 1, tmp_path)[fixed.index("--retention") + 1] \
        == "fixed:4.5"
    without = replace(load, conversation_keys=False)
    assert "--retention" not in servers.server_command("mars", engine, without, 1, tmp_path)
    with pytest.raises(ValueError, match="fixed"):
        servers.server_command("fixed", engine, without, 1, tmp_path)
    no_swap = replace(engine, marsched_extra=("--no-swap",))
    mars = servers.server_command("mars", no_swap, load, 1, tmp_path)
    assert mars.index("--no-swap") < mars.index("--")  # a marsched option, not a vLLM one
    assert "--no-swap" not in servers.server_command("vllm", no_swap, load, 1, tmp_path)


def test_the_template_renders_tool_calls_and_results():
    import jinja2

    messages = [{"role": "user", "content": "find it"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "x", "type": "function", "function": {"name": "lookup", "arguments": '{"city":"oslo"}'}}]},
                {"role": "tool", "tool_call_id": "x", "content": "cold"}]
    text = jinja2.Environment().from_string(servers.CHAT_TEMPLATE).render(messages=messages)
    assert text == 'find it\ncall lookup {"city":"oslo"}\nresult cold\n'


def result(cid, e2e, ttfts, error=None):
    turns = [client.Turn(cid, i, 0.0, ttft_s=t) for i, t in enumerate(ttfts)]
    return client.ConversationResult(cid, 0.0, e2e_s=e2e, turns=turns, error=error)


def test_summary_counts_follow_ups_only_and_failed_conversations():
    results = [result("a", 4.0, [9.0, 0.1, 0.3]), result("b", 6.0, [9.0, 0.2, 0.4]),
               result("c", None, [9.0, None], error="APIError: boom")]
    summary = report.summarize(results)
    assert summary["followup_turns"] == 4 and summary["followup_ttft_mean_s"] == pytest.approx(0.25)
    assert summary["followup_ttft_p50_s"] == pytest.approx(0.25) and summary["first_ttft_mean_s"] == 9.0
    assert summary["e2e_mean_s"] == 5.0 and summary["completed"] == 2 and summary["failed"] == 1
    assert summary["errors"] == ["APIError: boom"]
    assert report.percentile([1.0, 2.0, 3.0, 4.0], 99) == pytest.approx(3.97)
    assert report.percentile([], 50) is None


def test_table_rates_against_stock_vllm_and_names_a_configuration_that_did_not_run():
    def record(config, mean, p99, e2e, server):
        return {"config": config, "server": server, "summary": {
            "completed": 10, "conversations": 10, "followup_ttft_mean_s": mean, "followup_ttft_p50_s": mean,
            "followup_ttft_p99_s": p99, "e2e_mean_s": e2e, "e2e_p99_s": 2 * e2e}}

    records = [record("vllm", 0.4, 2.0, 8.0, {"prefix_cache_hit_rate": 0.5}),
               record("mars", 0.1, 0.5, 6.0, {"retention_hits": 25, "retention_misses": 5}),
               {"config": "fixed", "error": "server exited with status 2\nmore"}]
    lines = report.table(records).splitlines()
    assert lines[2].startswith("| vllm | 10/10 | 0.400 / 0.400 / 2.000 | 8.00 / 16.00 | 1.00, 1.00 | 1.00, 1.00 | – | 0.50 |")
    assert "| 0.25, 0.25 | 0.75, 0.75 | 25 / 5 |" in lines[3]
    assert lines[4].startswith("| fixed | did not run: server exited with status 2 |")


def test_the_soak_samples_the_process_tree_and_reads_what_is_left(tmp_path):
    import http.server
    import subprocess
    import sys
    import threading

    from marsched.experiments.conversations.report import soak_table
    from marsched.experiments.conversations.soak import RssSampler, after_idle

    child = subprocess.Popen([sys.executable, "-c", "import time; x = bytearray(64 << 20); time.sleep(30)"])
    try:
        time.sleep(1.0)
        sampler = RssSampler(child.pid, every_s=0.05)
        deadline = time.monotonic() + 60  # on a loaded machine the sampling thread runs late
        while len(sampler.samples) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        rss = sampler.stop()
    finally:
        child.kill()
        child.wait()
    assert len(rss["samples"]) >= 3 and rss["peak_mib"] >= 64  # the child's 64 MiB are counted

    state = {"data_parallel_size": 2, "ranks": [
        {"rank": 0, "host_bytes": 0,
         "scheduler": {"retained_swap": 0, "device_total_blocks": 10, "device_free_blocks": 10}},
        {"rank": 1, "host_bytes": 4096, "scheduler": {"retained_swap": 1, "device_total_blocks": 10,
                                                       "device_free_blocks": 7}}]}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = {"/health": b"", "/marsched/state": json.dumps(state).encode(),
                    "/metrics": b"vllm:kv_cache_usage_perc{engine=\"0\"} 0.25\n"}.get(self.path)
            self.send_response(200 if body is not None else 404)
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        left = after_idle(f"http://127.0.0.1:{server.server_port}", type("P", (), {"poll": lambda self: None})(), 0.0)
    finally:
        server.shutdown()
    assert left["alive"] and left["health"]
    assert (left["retained_swap"], left["host_bytes"], left["device_blocks_used"], left["kv_cache_usage"]) == \
        (1, 4096, 3, 0.25)
    row = soak_table([{"config": "mars", "summary": {"failed": 0}, "rss": rss, "after_idle": left}]).splitlines()[-1]
    assert "retained_swap 1" in row and "host_bytes 4096" in row and "device_blocks_used 3" in row

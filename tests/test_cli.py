"""The `marsched` command as a user runs it: real files, a real subprocess."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

RECORD_KEYS = {
    "engine", "policy", "profile", "trace", "qps", "duration_s", "seed", "predictor", "num_requests",
    "num_finished", "e2e_mean_s", "e2e_p50_s", "e2e_p99_s", "ttft_mean_s", "ttft_p99_s",
    "norm_latency_mean_s_per_token", "throughput_tokens_per_s", "max_queue_wait_s", "preemptions",
    "strategy_counts", "isolated_e2e_mean_s", "wallclock_s",
}


def marsched(*args, cwd=None):
    command = [sys.executable, "-m", "marsched.cli", *args]
    return subprocess.run(command, capture_output=True, text=True, cwd=cwd, timeout=300,
                          env={**os.environ, "COLUMNS": "200"})


def test_compare_writes_records_plot_and_table(tmp_path):
    out, plot = tmp_path / "out.json", tmp_path / "plot.png"
    run = marsched("compare", "--policies", "vllm,infercept,mars", "--qps", "2,4", "--duration", "40",
                   "--json", str(out), "--plot", str(plot), "--workers", "2")
    assert run.returncode == 0, run.stderr
    records = json.loads(out.read_text())
    assert len(records) == 6
    for record in records:
        assert RECORD_KEYS <= record.keys()
        assert record["num_finished"] == record["num_requests"] > 0  # the run drains
        assert record["e2e_mean_s"] >= record["isolated_e2e_mean_s"] - 1e-9
        assert record["engine"] == "sim" and record["profile"] == "gptj-6b-a100"
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "infercept" in run.stdout and "e2e mean" in run.stdout


def test_simulate_writes_an_event_trace(tmp_path):
    trace = tmp_path / "events.jsonl"
    run = marsched("simulate", "--policy", "mars", "--qps", "2", "--duration", "20", "--trace-out", str(trace))
    assert run.returncode == 0, run.stderr
    events = [json.loads(line) for line in trace.read_text().splitlines()]
    kinds = {e["event"] for e in events}
    assert {"arrive", "assign_strategy", "admit", "schedule", "api_start", "api_end", "resume", "finish"} <= kinds
    arrived = {e["rid"] for e in events if e["event"] == "arrive"}
    finished = {e["rid"] for e in events if e["event"] == "finish"}
    assert arrived == finished


@pytest.mark.parametrize("option,value,expected", [
    ("--policy", "fifo", "valid: vllm, vllm-v0, vllm-offload, infercept, infercept-code, sjf, preserve, discard, swap, mars, mars-boost, mars-boost-label, mars-nudge, continuum, continuum-public, autellix"),
    ("--profile", "h100", "valid: gptj-6b-a100, llama3-70b-4xh100, llama3-8b-h100, vicuna-13b-2xa100"),
    ("--predictor", "magic", "valid: online, foreknowledge (a bound), oracle, noisy:SIGMA"),
    ("--rest", "magic", "--rest magic: unknown rest rule 'magic'; valid: plan, mean, gittins"),
    ("--starvation-threshold", "-3", "positive number or 'off'"),
])
def test_unknown_names_list_the_valid_ones(tmp_path, option, value, expected):
    out = tmp_path / "out.json"
    run = marsched("simulate", option, value, "--duration", "5", "--json", str(out))
    assert run.returncode == 2
    assert expected in run.stderr
    assert not out.exists()


def test_malformed_trace_names_file_record_field_and_leaves_no_output(tmp_path):
    trace = tmp_path / "bad.json"
    trace.write_text(json.dumps({"good": [{"prompt_tokens": 5, "completion_tokens": 3}],
                                 "bad": [{"prompt_tokens": 5, "completion_tokens": -2}]}))
    out, plot = tmp_path / "out.json", tmp_path / "plot.png"
    run = marsched("compare", "--trace", str(trace), "--duration", "5", "--json", str(out), "--plot", str(plot))
    assert run.returncode == 2
    assert str(trace) in run.stderr and "'bad'" in run.stderr and "completion_tokens" in run.stderr
    assert not out.exists() and not plot.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.json"]


def test_bundled_trace_is_found_outside_the_repository(tmp_path):
    run = marsched("simulate", "--qps", "1", "--duration", "5", cwd=tmp_path)
    assert run.returncode == 0, run.stderr

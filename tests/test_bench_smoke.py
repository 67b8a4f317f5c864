"""CI smoke test of the real-engine benchmark: `marsched model` then `marsched bench` on real vLLM (CPU).

A tiny model, six requests of the single-API trace at one load, stock vLLM and MARS (two engines,
one after the other: the loop over points; INFERCEPT's rule on real vLLM is audited on a shared
engine in test_vllm_audit.py), API calls at 1/100 of their time. Each point starts an engine, whose
core and worker processes each import vLLM anew (vLLM's CPU platform always spawns them), which
is most of the test's time. The full runs are scripts whose results are in results/.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

pytest.importorskip("vllm")

from marsched.bench.engine_config import BLOCK_TOKENS, kv_blocks_for  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

TINY = ["--layers", "2", "--hidden", "128", "--heads", "4", "--kv-heads", "2", "--intermediate", "256",
        "--vocab", "512", "--max-position", "1024"]
KV_GB = 0.01
POLICIES = ("vllm", "mars")


def marsched(*args: str, timeout: float) -> subprocess.CompletedProcess:
    """The command as a user runs it, in its own process group (to look for what it leaves behind)."""
    env = {key: value for key, value in os.environ.items() if key != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    process = subprocess.Popen([sys.executable, "-m", "marsched.cli", *args], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        out, err = process.communicate(timeout=timeout)
    finally:
        left_behind = _alive_in_group(process.pid)
        if process.poll() is None:
            os.killpg(process.pid, 9)
    result = subprocess.CompletedProcess(process.args, process.returncode, out, err)
    result.left_behind = left_behind
    return result


def _alive_in_group(group: int, grace_s: float = 10.0) -> list[str]:
    """The group's processes still alive `grace_s` after the command returned.

    Exited children wait as zombies for a parent that reaps them (in a container, maybe never):
    not alive. A child may still be on its way out when the command returns (state R, its
    arguments already gone, on a loaded machine): it gets the grace period.
    """
    deadline = time.monotonic() + grace_s
    while True:
        listing = subprocess.run(["ps", "-o", "pid=,stat=,args=", "-g", str(group)], capture_output=True,
                                 text=True).stdout
        alive = [line for line in listing.splitlines() if line.split()[1:2] != ["Z"]]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def test_model_then_bench_end_to_end(tmp_path):
    model, out = tmp_path / "model", tmp_path / "bench.json"
    built = marsched("model", "--out", str(model), *TINY, timeout=300)
    assert built.returncode == 0, built.stderr
    assert (model / "config.json").exists() and (model / "tokenizer.json").exists()
    assert json.loads((model / "marsched_model.json").read_text())["tokenizer_vocab"] == 512

    run = marsched("bench", "--model", str(model), "--trace", "single", "--policies", ",".join(POLICIES),
                   "--qps", "4", "--duration", "5", "--max-requests", "6", "--api-time-scale", "0.01",
                   "--token-scale", "0.1", "--kv-cache-gb", str(KV_GB), "--json", str(out), timeout=540)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.left_behind == [], f"processes left after marsched bench: {run.left_behind}"

    records = json.loads(out.read_text())
    assert [r["policy"] for r in records] == list(POLICIES)
    blocks = kv_blocks_for(KV_GB, 512) - 1  # 512 bytes of bf16 KV per token; vLLM keeps one block back
    for r in records:
        assert r["engine"] == "vllm" and r["partial"] is False and r["num_errors"] == 0, r
        assert r["num_requests"] == 6 and r["num_finished"] == r["num_requests"]
        assert 0 < r["ttft_mean_s"] <= r["e2e_mean_s"] <= r["e2e_p99_s"]
        assert r["isolated_e2e_mean_s"] > 0 and r["throughput_tokens_per_s"] > 0
        assert sum(r["strategy_counts"].values()) == 6  # one call per request in the single-API trace
        it = r["iteration"]
        assert it["count"] > 0 and r["iterations"] == it["count"]
        assert 0 < it["p50_s"] <= it["p99_s"] and it["mean_s"] > 0
        assert 0 < it["schedule_p50_s"] < it["p50_s"]  # the scheduler's share of a step
        assert r["kv_cache"]["blocks"] == blocks and r["kv_cache"]["block_tokens"] == BLOCK_TOKENS
        assert r["kv_cache"]["tokens"] == blocks * BLOCK_TOKENS and r["kv_cache"]["max_model_len"] == 1024
        assert r["model"]["layers"] == 2 and r["model"]["dtype"] == "bfloat16"
        assert r["api_time_scale"] == 0.01 and r["token_scale"] == 0.1
    assert set(records[0]["strategy_counts"]) == {"discard"}  # stock vLLM ends a request at its call
    assert "vllm" in run.stdout and "KV cache" in run.stdout
    print({r["policy"]: round(r["wallclock_s"], 1) for r in records})  # engine start-up dominates

"""CI smoke test of the real-engine benchmark: `marsched model` then `marsched bench` on real vLLM (CPU).

A tiny model, six requests of the single-API trace at one load, stock vLLM and MARS (two engines,
one after the other: the loop over points; INFERCEPT's rule on real vLLM is audited on a shared
engine in test_vllm_audit.py), API calls at 1/100 of their time. Each point starts an engine, whose
core and worker processes each import vLLM anew (vLLM's CPU platform always spawns them), which
is most of the command's time; it runs in the background (`commands.BENCH`). The full runs are
scripts whose results are in results/.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm")

from commands import BENCH_KV_GB, BENCH_POLICIES  # noqa: E402
from marsched.bench.engine_config import BLOCK_TOKENS, kv_blocks_for  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

KV_GB, POLICIES = BENCH_KV_GB, BENCH_POLICIES


def test_model_then_bench_end_to_end(bench_run):
    model, out = bench_run.folder / "model", bench_run.folder / "bench.json"
    built, run = bench_run.steps
    assert built.returncode == 0, built.stderr
    assert (model / "config.json").exists() and (model / "tokenizer.json").exists()
    assert json.loads((model / "marsched_model.json").read_text())["tokenizer_vocab"] == 512

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

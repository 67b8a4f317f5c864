"""scripts/sim_vs_bench.py (marsched.experiments.sim_vs_bench): a bench record's stream replayed on the simulator."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from marsched.experiments import sim_vs_bench

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "sim_vs_bench.py"


def _module():
    return sim_vs_bench


def _record(policy: str, e2e_mean_s: float) -> dict:
    return {"engine": "vllm", "policy": policy, "qps": 2.0, "trace": "single", "duration_s": 10.0, "seed": 0,
            "predictor": "oracle+api:type-mean", "token_scale": 0.5, "api_time_scale": 0.1, "partial": False,
            "e2e_mean_s": e2e_mean_s, "e2e_p99_s": 2 * e2e_mean_s, "num_requests": 1000,
            "kv_cache": {"blocks": 39, "block_tokens": 128, "max_model_len": 4096, "max_num_batched_tokens": 2048}}


def test_the_simulated_point_uses_the_bench_capacity_and_stream():
    module = _module()
    record = _record("mars", 1.0)
    light = module.simulate_point(record, "gptj-6b-a100")
    busy = {**record, "qps": 20.0}
    roomy = module.simulate_point({**busy, "kv_cache": {**record["kv_cache"], "blocks": 400}}, "gptj-6b-a100")
    tight = module.simulate_point(busy, "gptj-6b-a100")
    # The record's rate sets the stream; its KV blocks set the capacity (39 blocks queue at 20 qps).
    assert 0 < light["num_finished"] < roomy["num_finished"] == tight["num_finished"]
    assert tight["e2e_mean_s"] > 1.2 * roomy["e2e_mean_s"]
    # A bench cut short with --max-requests ran its first `num_requests`: so does the simulator.
    assert module.simulate_point({**record, "num_requests": 5}, "gptj-6b-a100")["num_finished"] == 5


def test_the_command_prints_errors_and_orders(tmp_path):
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps([_record("mars", 1.0), _record("vllm", 2.0), {**_record("infercept", 1.0), "partial": True}]))
    out = tmp_path / "cmp.json"
    run = subprocess.run([sys.executable, str(SCRIPT), str(bench), "--profile", "gptj-6b-a100", "--json", str(out)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [r["policy"] for r in rows] == ["mars", "vllm"]  # the partial point is left out
    for row in rows:
        assert row["error"] == pytest.approx(row["sim_e2e_mean_s"] / row["bench_e2e_mean_s"] - 1)
    assert "bench order mars < vllm" in run.stdout


def test_a_file_that_is_not_a_bench_run_is_an_error(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"records": 1}')
    run = subprocess.run([sys.executable, str(SCRIPT), str(bad), "--profile", "gptj-6b-a100"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "not a marsched bench JSON" in run.stderr

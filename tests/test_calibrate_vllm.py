"""`marsched calibrate --fast` on real vLLM (CPU) with the tests' tiny model: the profile it writes
loads, states the engine's measured capacity, and every fitted constant says where it comes from.

A fast plan (3 prefill sizes, 2 × 2 decode points, few repeats): under a minute on 2 cores, most
of it vLLM's start-up. It runs in the background beside the other tests (`commands.CALIBRATE`), so
the fit's quality is not checked (the tiny model is framework overhead and the machine is busy);
the real calibration is in results/calibrated-cpu.json.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm")

from commands import CALIBRATE_KV_GB  # noqa: E402
from marsched.bench.engine_config import kv_blocks_for  # noqa: E402
from marsched.sim.profile import load_profile  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

KV_GB = CALIBRATE_KV_GB


def test_calibrate_fast_writes_a_loadable_profile(calibrate_run):
    out = calibrate_run.folder / "calibrated.json"
    run = calibrate_run.last
    assert run.left_behind == [], f"processes left after marsched calibrate: {run.left_behind}"
    for line in ("starting vLLM", "[1/", "decode batch 4 × context 256", "swap copies"):
        assert line in run.stderr  # progress
    if run.returncode == 2 and "too noisy" in run.stderr:
        # The tiny model's cost per token is microseconds: on a busy machine the fit can put it at
        # zero, and calibrate then says so and writes nothing (a timing outcome, not a failure).
        assert "must be > 0" in " ".join(run.stderr.split()) and not out.exists()
        return
    assert run.returncode == 0, run.stderr[-3000:]
    assert "fit: t =" in run.stdout and "R²" in run.stdout and f"profile: {out}" in " ".join(run.stdout.split())

    data = json.loads(out.read_text())
    profile = load_profile(str(out))
    blocks = kv_blocks_for(KV_GB, 2 * 2 * 2 * 32 * 4) - 1  # float32 tiny model: 1,024 bytes per token; null block
    assert profile.device_blocks == data["device_blocks"] == blocks and profile.block_tokens == 128
    assert profile.kv_bytes_per_token == 1024
    # Any one fitted term may be 0 on a busy machine (non-negative least squares); an iteration may not.
    assert profile.cost.iteration_time(1, 1, 1) > 0 and profile.cost.swap_tokens_per_s > 0
    for key in ("iteration_ms_fixed", "iteration_ms_per_token", "iteration_us_per_context_token",
                "iteration_ms_per_sequence"):
        assert data[key] >= 0
        assert "measured by marsched calibrate" in data[f"{key}_source"] and "R²" in data[f"{key}_source"]
    m = data["measurements"]
    assert [s["new_tokens"] for s in m["prefill"]] == [16, 64, 256]
    points = {(s["sequences"], round(s["context_tokens"] / s["sequences"] / 32) * 32) for s in m["decode"]}
    assert points == {(1, 32), (1, 256), (4, 32), (4, 256)}  # context per sequence: the prompt and a few decoded
    assert m["fit"]["samples"] == len(m["prefill"]) + len(m["decode"]) >= 6
    assert data["swap_out_ms_per_block"] > 0 and data["swap_in_ms_per_block"] > 0

"""The regime map: its scaling knobs, how a point is classified, the ratio table, and the command."""

import json
import os
import subprocess
import sys

import pytest

from marsched.bench.runner import RunSpec, run_one
from marsched.regime.table import Regime, Thresholds, classify, distinct_values, regime_cells, text_table
from marsched.sim.profile import load_profile, scale_kv_capacity
from marsched.workload.model import ApiCall, ApiType, build_request, scale_api_time


def _record(policy, *, qps=4.0, kv=1.0, api=1.0, mean=10.0, p99=50.0, floor=10.0, wait=0.0, duration=300.0):
    return {"policy": policy, "qps": qps, "kv_scale": kv, "api_time_scale": api, "e2e_mean_s": mean,
            "e2e_p99_s": p99, "isolated_e2e_mean_s": floor, "max_queue_wait_s": wait, "duration_s": duration}


# --- the knobs ----------------------------------------------------------------------------------


def test_kv_scale_multiplies_device_blocks_only():
    p = load_profile("gptj-6b-a100")
    half, double = scale_kv_capacity(p, 0.5), scale_kv_capacity(p, 2)
    assert (half.device_blocks, double.device_blocks) == (407, 1628)
    assert half.host_blocks == p.host_blocks and half.cost == p.cost and half.block_tokens == p.block_tokens
    assert scale_kv_capacity(p, 1e-9).device_blocks == 1  # never an engine without memory
    for bad in (0, -1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="KV capacity scale"):
            scale_kv_capacity(p, bad)


def test_api_time_scale_multiplies_durations_and_nothing_else():
    request = build_request("r", 100, [(10, ApiCall(ApiType.MATH, 2.0, 5)), (20, ApiCall(ApiType.QA, 0.5, 7)),
                                       (3, None)], arrival_s=1.5)
    slow = scale_api_time(request, 3)
    assert [s.api.duration_s for s in slow.segments[:2]] == [6.0, 1.5]
    assert slow.api_time_s == pytest.approx(3 * request.api_time_s)
    assert [(s.context_tokens, s.output_tokens) for s in slow.segments] == \
        [(s.context_tokens, s.output_tokens) for s in request.segments]
    assert slow.arrival_s == 1.5 and slow.segments[-1].api is None
    with pytest.raises(ValueError, match="API time scale"):
        scale_api_time(request, float("nan"))


def test_a_run_records_its_scales_and_less_memory_costs_latency():
    base = RunSpec("infercept", 16.0, "single", duration_s=40.0)
    full = run_one(base)
    small = run_one(RunSpec("infercept", 16.0, "single", duration_s=40.0, kv_scale=0.25))
    slow = run_one(RunSpec("infercept", 16.0, "single", duration_s=40.0, api_time_scale=2.0))
    assert (full["kv_scale"], full["api_time_scale"]) == (1.0, 1.0)
    assert (small["kv_scale"], slow["api_time_scale"]) == (0.25, 2.0)
    assert small["num_requests"] == full["num_requests"] == slow["num_requests"]  # the same arrivals
    assert small["e2e_mean_s"] > full["e2e_mean_s"]
    assert small["preemptions"] > full["preemptions"]
    # Twice the API time: the floor rises by the trace's mean API time (the requests are the same).
    assert slow["isolated_e2e_mean_s"] > full["isolated_e2e_mean_s"] + 1


# --- classification and the table ---------------------------------------------------------------


def test_light_when_every_policy_is_within_the_excess_of_its_floor():
    base, mars = _record("infercept", mean=10.9), _record("mars", mean=10.5)
    assert classify(base, mars) is Regime.LIGHT
    assert classify(_record("infercept", mean=11.1), mars) is Regime.SATURATED  # INFERCEPT past 10%
    assert classify(base, _record("mars", mean=11.1)) is Regime.SATURATED  # MARS past 10% counts too
    assert classify(_record("infercept", mean=11.1), mars, Thresholds(light_excess=0.2)) is Regime.LIGHT


def test_overloaded_when_infercepts_longest_wait_passes_the_fraction_of_the_window():
    mars = _record("mars", mean=30.0)
    assert classify(_record("infercept", mean=40.0, wait=29.0), mars) is Regime.SATURATED  # 29 s < 10% of 300 s
    assert classify(_record("infercept", mean=40.0, wait=31.0), mars) is Regime.OVERLOADED
    assert classify(_record("infercept", mean=40.0, wait=31.0, duration=600.0), mars) is Regime.SATURATED
    # Only INFERCEPT's queue decides: a long MARS wait alone is not overload.
    assert classify(_record("infercept", mean=40.0, wait=1.0), _record("mars", wait=200.0)) is Regime.SATURATED
    # Overload wins over "light": a long wait with a near-floor mean is still a growing queue.
    assert classify(_record("infercept", wait=100.0), _record("mars")) is Regime.OVERLOADED


def test_cells_are_mars_over_infercept_per_point():
    records = [
        _record("infercept", qps=8, kv=0.5, mean=20.0, p99=100.0), _record("mars", qps=8, kv=0.5, mean=15.0, p99=120.0),
        _record("vllm", qps=8, kv=0.5, mean=99.0),  # other policies are ignored
        _record("mars", qps=4, kv=0.5, mean=10.0), _record("infercept", qps=4, kv=0.5, mean=10.0),
        _record("infercept", qps=4, kv=0.5, api=2, mean=10.0), _record("mars", qps=4, kv=0.5, api=2, mean=9.0),
    ]
    cells = regime_cells(records)
    assert [(c.qps, c.kv_scale, c.api_time_scale) for c in cells] == [(4, 0.5, 1), (4, 0.5, 2), (8, 0.5, 1)]
    last = cells[-1]
    assert (last.mean_ratio, last.p99_ratio) == (0.75, 1.2)
    assert last.regime is Regime.SATURATED and last.baseline_over_floor == 2.0
    assert cells[1].mean_ratio == 0.9
    assert cells[0].regime is Regime.LIGHT
    assert cells[-1].as_dict()["regime"] == "saturated"
    text = text_table(cells)
    assert "0.75/1.20 S" in text and "API time ×2" in text


def test_cells_need_exactly_one_record_per_policy_and_point():
    with pytest.raises(ValueError, match="no mars record at qps 4, kv scale 0.5, API-time scale 1"):
        regime_cells([_record("infercept", kv=0.5)])
    with pytest.raises(ValueError, match="two infercept records at qps 4"):
        regime_cells([_record("infercept"), _record("infercept"), _record("mars")])


def test_an_axis_value_given_twice_is_an_error():
    assert distinct_values("2,1", [2.0, 1.0], "--qps") == [1.0, 2.0]
    with pytest.raises(ValueError, match=r"--kv-scale '1,0.5,1': 1 is given twice"):
        distinct_values("1,0.5,1", [1.0, 0.5, 1.0], "--kv-scale")


# --- the command --------------------------------------------------------------------------------


def marsched(*args):
    return subprocess.run([sys.executable, "-m", "marsched.cli", *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "COLUMNS": "200"})


def test_regime_command_writes_cells_records_and_heat_map(tmp_path):
    out, plot = tmp_path / "map.json", tmp_path / "map.png"
    run = marsched("regime", "--trace", "single", "--qps", "2,16", "--kv-scale", "0.25,1", "--api-time-scale", "1",
                   "--duration", "20", "--workers", "1", "--json", str(out), "--plot", str(plot))
    assert run.returncode == 0, run.stderr
    document = json.loads(out.read_text())
    assert document["trace"] == "single" and document["duration_s"] == 20
    assert document["predictor"] == "online+api:past-mean"  # knowable by default: MARS, not its bound
    assert len(document["cells"]) == 4 and len(document["records"]) == 8
    assert {(c["qps"], c["kv_scale"]) for c in document["cells"]} == {(2, 0.25), (2, 1), (16, 0.25), (16, 1)}
    assert all(c["regime"] in ("light", "saturated", "overloaded") for c in document["cells"])
    light = next(c for c in document["cells"] if (c["qps"], c["kv_scale"]) == (2, 1))
    assert light["regime"] == "light" and light["mean_ratio"] == pytest.approx(1, abs=0.01)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "[8/8]" in run.stderr  # progress, one line per run
    assert "API time ×1" in run.stdout


@pytest.mark.parametrize("args, message", [
    (["--qps", "4,4"], "--qps '4,4': 4 is given twice"),
    (["--qps", "4,-1"], "--qps '4,-1': give finite numbers > 0"),
    (["--kv-scale", "0"], "--kv-scale '0': give finite numbers > 0"),
    (["--api-time-scale", "x"], "--api-time-scale 'x': give comma-separated numbers"),
    (["--trace", "agent", "--kv-scale", "0.1,1"], "--kv-scale 0.1: 81 KV blocks, but the longest request of trace agent needs"),
    (["--duration", "0"], "--duration 0: give a finite number of seconds > 0"),
    (["--overload-wait", "0"], "--overload-wait 0: give a fraction > 0"),
    (["--api-estimator", "mean"], "--api-estimator mean: unknown API estimator 'mean'"),
    (["--profile", "nope"], "--profile nope: unknown profile 'nope'"),
    (["--trace", "nope"], "--trace nope:"),
])
def test_regime_command_rejects_bad_axes_before_running(tmp_path, args, message):
    out = tmp_path / "map.json"
    run = marsched("regime", "--json", str(out), *args)
    assert run.returncode == 2
    assert message in " ".join(run.stderr.split())
    assert not out.exists()


def test_regime_command_needs_somewhere_to_write():
    run = marsched("regime", "--qps", "4")
    assert run.returncode == 2 and "give --json, --plot or both" in run.stderr

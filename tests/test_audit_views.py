"""`marsched plot` and `marsched export --perfetto`: a trace as spans and counters, drawn and exported.

The Perfetto file is checked structurally against what Perfetto's JSON importer needs (the
`perfetto` package's trace processor downloads its binary at run time, which this offline
machine cannot; see the README).
"""

from __future__ import annotations

import json

from marsched.audit.perfetto import chrome_trace
from marsched.audit.timeline import State, build_timeline
from marsched.policy import make_policy
from simhelpers import COST
from test_audit import STRESS, simulate
from test_cli import marsched
from test_trace_consistency import _workload

PNG = b"\x89PNG\r\n\x1a\n"


def stressed_trace(tmp_path):
    path = tmp_path / "run.jsonl"
    policy = make_policy("mars", COST, starvation="iterations", starvation_threshold=5, admission="greedy")
    simulate(path, policy, **STRESS)
    return path


def test_each_request_is_a_gapless_sequence_of_spans_from_arrival_to_finish(tmp_path):
    path = stressed_trace(tmp_path)
    events = [json.loads(line) for line in path.read_text().splitlines()]
    timeline = build_timeline(path)
    assert timeline.requests == [e["rid"] for e in events if e["event"] == "arrive"]
    for rid in timeline.requests:
        spans = [s for s in timeline.spans if s.rid == rid]
        arrive = next(e["t"] for e in events if e["event"] == "arrive" and e["rid"] == rid)
        finish = next(e["t"] for e in events if e["event"] == "finish" and e["rid"] == rid)
        assert spans[0].start == arrive and spans[-1].end == finish
        assert all(a.end == b.start for a, b in zip(spans, spans[1:]))  # no gap, no overlap
    states = {s.state for s in timeline.spans}
    assert {State.WAITING, State.RUNNING, State.SWAP_OUT, State.CALL_SWAP, State.SWAP_IN} <= states
    # The counters: every request is in exactly one queue until it finishes; memory is back to 0.
    assert max(sum(timeline.queues[q][i] for q in timeline.queues) for i in range(len(timeline.times))) <= 11
    assert timeline.kv_device[-1] == timeline.kv_host[-1] == 0


def test_plot_draws_a_trace_and_latency_cdfs(tmp_path):
    path = stressed_trace(tmp_path)
    run = marsched("plot", str(path), "--out", str(tmp_path / "run.png"))
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "run.png").read_bytes()[:8] == PNG
    metrics = tmp_path / "m.json"
    run = marsched("compare", "--policies", "infercept,mars", "--qps", "4", "--duration", "20", "--json", str(metrics),
                   "--workers", "1")
    assert run.returncode == 0, run.stderr
    assert all(len(r["e2e_cdf_s"]) == 101 for r in json.loads(metrics.read_text()))
    run = marsched("plot", "--metrics", str(metrics), "--out", str(tmp_path / "cdf.png"))
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "cdf.png").read_bytes()[:8] == PNG
    metrics.write_text(json.dumps([{"policy": "mars", "e2e_mean_s": 1.0}]))
    run = marsched("plot", "--metrics", str(metrics))
    assert run.returncode == 2 and "no latency distribution" in run.stderr


def test_perfetto_export_has_a_track_per_request_and_counters(tmp_path):
    path = stressed_trace(tmp_path)
    out = tmp_path / "run.perfetto.json"
    run = marsched("export", str(path), "--perfetto", str(out))
    assert run.returncode == 0, run.stderr
    document = json.loads(out.read_text())
    assert document == chrome_trace(build_timeline(path))
    events = document["traceEvents"]
    assert {e["ph"] for e in events} == {"M", "X", "C"}
    for event in events:
        assert isinstance(event["pid"], int) and isinstance(event["tid"], int) and isinstance(event["name"], str)
        if event["ph"] != "M":
            assert event["ts"] >= 0
    names = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert sorted(names.values()) == sorted(r.request_id for r in _workload())
    slices: dict[int, list[dict]] = {}
    for event in events:
        if event["ph"] == "X":
            assert event["dur"] >= 0 and event["tid"] in names
            slices.setdefault(event["tid"], []).append(event)
    for track in slices.values():  # slices on one track must not overlap (Perfetto nests them otherwise)
        track.sort(key=lambda e: e["ts"])
        assert all(a["ts"] + a["dur"] <= b["ts"] + 1e-3 for a, b in zip(track, track[1:]))
    assert {e["name"] for e in events if e["ph"] == "X"} >= {"waiting", "running", "call: swap", "swapping out"}
    counters = [e for e in events if e["ph"] == "C"]
    assert {e["name"] for e in counters} == {"queue length", "KV blocks in use"}
    assert all(all(isinstance(v, int) for v in e["args"].values()) for e in counters)


def test_unreadable_traces_are_an_error_with_the_line_for_plot_and_export(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"event": "run", "t": 0}\n')
    for args in (["plot", str(tmp_path / "bad.jsonl")], ["export", str(tmp_path / "bad.jsonl"), "--perfetto",
                                                          str(tmp_path / "o.json")]):
        run = marsched(*args)
        assert run.returncode == 2 and "line 1: run event without" in run.stderr and "Traceback" not in run.stderr

"""The live twin (`marsched.experiments.twin`): the simulator replays exactly what loadgen sends, the
loads are picked by the stated rule, the records and table say what was measured; one short live
run of one configuration (`vllm` mark, the CI smoke)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from marsched.experiments.twin import __main__ as twin_cli
from marsched.experiments.twin.configs import twin_policy
from marsched.experiments.twin.loads import SweepPoint, parse_loads, pick_loads
from marsched.experiments.twin.records import (
    SCHEMA, Load, TwinRecord, live_numbers, markdown, prompt_tokens_ratio, rows, swapped_pairs,
)
from marsched.experiments.twin.stream import as_replayed, replayed_requests
from marsched.loadgen.arrivals import session_arrivals
from marsched.loadgen.options import CLAUDE_CODE, LoadgenOptions, load_sessions
from marsched.loadgen.session import shape_gap
from marsched.policy.cost_model import CostModel
from marsched.policy.policy import Order, StrategyRule
from marsched.policy.ttl import ConstantTtl
from marsched.workload.model import ApiCall, ApiType, build_request

LOAD = LoadgenOptions("http://127.0.0.1:1", CLAUDE_CODE, None, 0.5, 40.0, 3, 0.1, 2.0, 0.01, 4)
PROFILE = "results/twin/profile.json"


def test_the_simulator_replays_the_tasks_loadgen_sends_at_the_same_times_and_shapes():
    sent = session_arrivals(load_sessions(LOAD), LOAD.rate, LOAD.duration_s, LOAD.seed)
    simulated = replayed_requests(LOAD)
    assert len(sent) == len(simulated) > 5
    for arrival, request in zip(sent, simulated):
        assert arrival.conversation == request.request_id
        assert arrival.arrival_s == pytest.approx(request.arrival_s)
        turns = arrival.session.turns
        assert [t.reply_tokens for t in turns] == [s.output_tokens for s in request.segments]
        gaps = [shape_gap(t.gap_s, LOAD.gap_scale, LOAD.max_gap_s) for t in turns[:-1]]
        assert gaps == pytest.approx([s.api.duration_s for s in request.segments[:-1]])
        last = request.segments[-1].api
        assert (last is None or last.duration_s == 0) and len(turns) <= LOAD.max_turns


def test_a_replayed_task_is_cut_its_gaps_shaped_and_no_tool_follows_its_last_call():
    call = ApiCall(ApiType.OTHER, 30.0, 5)
    request = build_request("r", 10, [(4, call), (5, call), (6, call), (7, None)])
    cut = as_replayed(request, 2, 0.1, 2.5)
    assert [s.output_tokens for s in cut.segments] == [4, 5]
    assert [s.api.duration_s for s in cut.segments] == pytest.approx([2.5, 0.0])
    whole = as_replayed(request, 0, 0.05, None)
    assert [s.api.duration_s for s in whole.segments[:3]] == pytest.approx([1.5, 1.5, 1.5])
    assert whole.segments[3].api is None


def test_the_twin_refuses_a_workload_other_than_claude_code():
    with pytest.raises(ValueError, match="claude-code"):
        replayed_requests(replace(LOAD, workload="agent-text"))


def test_continuum_is_mars_order_with_every_call_pinned_for_its_time_to_live():
    cost = CostModel(1e-5, 0.01, 2048, 1e9)
    policy = twin_policy("continuum", cost, 3.0)
    assert policy.order is Order.MEMORY_TIME and policy.rule is StrategyRule.TTL
    assert isinstance(policy.ttl, ConstantTtl) and policy.ttl.ttl_s("bash", 100) == 3.0
    assert twin_policy("mars", cost, 3.0).rule is StrategyRule.AHEAD
    assert all(twin_policy(c, cost, 3.0).predictor.length.name == "online" for c in ("mars", "vllm", "infercept"))
    # INFERCEPT's call decision prices the predicted call time, as the live server must
    assert not twin_policy("infercept", cost, 3.0).reads_true_call_time and twin_policy("mars", cost, 3.0).reads_true_call_time
    with pytest.raises(ValueError, match="no simulated policy"):
        twin_policy("mars-oracle", cost, 3.0)


def test_loads_are_where_every_configuration_is_light_and_where_every_one_queues():
    # Slowdowns over each one's least: a 1.0, 1.04, 1.2, 1.6, 3.0; b 1.0, 1.02, 1.6, 1.4, 2.0.
    a = [SweepPoint("a", r, m, 10.0) for r, m in ((0.1, 12.0), (0.2, 12.5), (0.4, 14.4), (0.8, 19.2), (1.6, 36.0))]
    b = [SweepPoint("b", r, m, 10.0) for r, m in ((0.1, 10.0), (0.2, 10.2), (0.4, 16.0), (0.8, 14.0), (1.6, 20.0))]
    assert pick_loads(a + b) == (Load("light", 0.2), Load("queueing", 1.6))
    assert pick_loads(a) == (Load("light", 0.2), Load("queueing", 0.8))
    with pytest.raises(ValueError, match="no rate of the grid queues"):
        pick_loads(a[:3] + b[:3])
    with pytest.raises(ValueError, match="add lower rates"):
        pick_loads([SweepPoint("a", 1.0, 10.0, 10.0), SweepPoint("a", 2.0, 20.0, 10.0),
                    SweepPoint("b", 1.0, 20.0, 10.0), SweepPoint("b", 2.0, 10.0, 10.0)])


@pytest.mark.parametrize("text, message", [("light", "NAME:RATE"), ("light:0", "NAME:RATE"), ("a:1,a:2", "twice"),
                                           ("", "give NAME:RATE"), ("x:abc", "NAME:RATE")])
def test_bad_loads_are_refused_naming_the_part(text, message):
    with pytest.raises(ValueError, match=message):
        parse_loads(text)


def _record(config, load, repeat, sim_mean, live_mean):
    live = None if live_mean is None else {"e2e_mean_s": live_mean, "e2e_p99_s": 2 * live_mean}
    return TwinRecord(config, load, repeat, {"e2e_mean_s": sim_mean, "e2e_p99_s": 2 * sim_mean}, live)


def test_the_table_puts_live_medians_beside_the_simulated_with_the_ratio():
    light = Load("light", 0.1)
    records = [_record("vllm", light, 1, 10.0, 11.0), _record("vllm", light, 2, 10.0, 13.0),
               _record("vllm", light, 3, 10.0, 12.0), _record("mars", light, 1, 8.0, 20.0)]
    table = markdown(records)
    assert "| vllm | 10.00 | 12.00 (11.00–13.00) | 1.20 ✗ |" in table
    assert "| mars | 8.00 | 20.00 | 2.50 ✗ |" in table
    assert "rank the configurations differently" in table
    assert swapped_pairs(rows(records[:3] + [_record("mars", light, 1, 8.0, 9.0)])) == []
    assert swapped_pairs(rows([_record("mars", light, 1, 8.0, None)])) is None
    # Simulated within 1% of each other: either live order ranks them alike; 2% apart: it does not.
    assert swapped_pairs(rows([_record("a", light, 1, 10.0, 11.0), _record("b", light, 1, 10.05, 10.5)])) == []
    assert swapped_pairs(rows([_record("a", light, 1, 10.0, 11.0), _record("b", light, 1, 10.2, 10.5)])) != []


def test_a_pair_ranked_the_other_way_live_says_whether_the_repeats_settle_it():
    light = Load("light", 0.1)
    apart = [_record("a", light, r, 10.0, live) for r, live in ((1, 12.0), (2, 12.5), (3, 13.0))] + \
            [_record("b", light, r, 11.0, live) for r, live in ((1, 10.5), (2, 11.0), (3, 11.9))]
    [pair] = swapped_pairs(rows(apart))
    assert (pair.sim_better.config, pair.live_better.config, pair.within_spread) == ("a", "b", False)
    assert "b before a live, live ranges apart" in markdown(apart)
    overlapping = apart[:-1] + [_record("b", light, 3, 11.0, 12.0)]  # a's best 12.0 against b's worst
    [pair] = swapped_pairs(rows(overlapping))
    assert pair.within_spread and "b before a live, live ranges overlap" in markdown(overlapping)
    assert swapped_pairs(rows([_record("a", light, 1, 10.0, 11.0), _record("b", light, 1, 11.0, 12.0)])) == []
    assert swapped_pairs(rows([_record("a", light, 1, 10.0, 11.0), _record("b", light, 1, 11.0, 11.0)])) == []  # a tie
    assert "rank the configurations alike" in markdown([_record("a", light, 1, 10.0, 11.0)])


def test_the_live_prompts_are_set_against_the_simulated_contexts_turn_by_turn():
    report = {"conversations": {"e2e_mean_s": 3.0, "e2e_p99_s": 5.0, "finished": 2}, "turns": {"failed": 1},
              "records": [{"conversation": "a#0", "turns": [{"index": 0, "prompt_tokens": 110},
                                                            {"index": 1, "prompt_tokens": 230}]},
                          {"conversation": "b#1", "turns": [{"index": 0, "prompt_tokens": None}]}]}
    contexts = {"a#0": [100, 200], "b#1": [50]}
    assert prompt_tokens_ratio(report, contexts) == pytest.approx(340 / 300)
    live = live_numbers(report, contexts)
    assert live["e2e_mean_s"] == 3.0 and live["turns_failed"] == 1
    assert live["prompt_tokens_ratio"] == pytest.approx(340 / 300)
    assert prompt_tokens_ratio({"records": []}, contexts) is None


@pytest.mark.parametrize("flags, message", [
    (["--loads", "light:-1"], "NAME:RATE"),
    (["--configs", "mars-oracle"], "no simulated twin"),
    (["--profile", "/nonexistent.json"], "no such file"),
    (["--repeats", "0"], "--repeats 0"),
    (["--kv-blocks", "0"], "--kv-blocks 0"),
    (["--kv-blocks", "32", "--max-model-len", "4096"], "give at least 33"),
    (["--token-scale", "0"], "--token-scale"),
    (["--out", "/dev/null"], "--out /dev/null: /dev/null is not a directory"),
])
def test_bad_flags_are_refused_before_anything_runs(tmp_path, capsys, flags, message):
    argv = ["--model", "m", "--profile", PROFILE, "--out", str(tmp_path / "out"), "--sim-only", *flags]
    assert twin_cli.main(argv) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_grid_with_no_queueing_rate_is_refused_with_the_sweep_and_no_traceback(tmp_path, capsys):
    argv = ["--model", "m", "--profile", PROFILE, "--out", str(tmp_path / "out"), "--sim-only", "--configs", "mars",
            "--grid", "0.05,0.1", "--duration", "20", "--max-turns", "3", "--token-scale", "0.01"]
    assert twin_cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "error: no rate of the grid queues" in err and "0.05/s" in err and "add higher rates to --grid" in err
    assert "Traceback" not in err
    assert not (tmp_path / "out" / "records.json").exists()


def test_a_simulated_only_twin_writes_one_record_per_configuration_and_load(tmp_path):
    out = tmp_path / "twin"
    argv = ["--model", "m", "--profile", PROFILE, "--out", str(out), "--sim-only", "--configs", "vllm-stock,mars",
            "--loads", "light:0.05,queueing:0.5", "--duration", "20", "--max-turns", "3", "--token-scale", "0.01"]
    assert twin_cli.main(argv) == 0
    result = json.loads((out / "records.json").read_text())
    assert result["schema"] == SCHEMA
    assert [(r["config"], r["load"]["name"]) for r in result["records"]] == [
        ("vllm-stock", "light"), ("mars", "light"), ("vllm-stock", "queueing"), ("mars", "queueing")]
    for record in result["records"]:
        assert record["sim"]["e2e_mean_s"] > 0 and record["sim"]["e2e_p99_s"] >= record["sim"]["e2e_mean_s"]
        assert record["live"] is None
    assert "### queueing: 0.5 tasks/s" in (out / "table.md").read_text()


@pytest.mark.vllm
def test_a_short_live_twin_writes_simulated_and_live_numbers_per_task(twin_run):
    out = twin_run.folder / "twin"
    run = twin_run.last
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads((out / "records.json").read_text())
    assert result["schema"] == SCHEMA
    (record,) = result["records"]
    assert record["config"] == "mars" and record["load"] == {"name": "smoke", "rate": 1.0} and record["repeat"] == 1
    for side in ("sim", "live"):
        assert record[side]["e2e_mean_s"] > 0 and record[side]["e2e_p99_s"] >= record[side]["e2e_mean_s"]
    assert record["live"]["turns_failed"] == 0 and record["error"] is None
    assert record["live"]["prompt_tokens_ratio"] == pytest.approx(1.0, abs=0.1)  # a token a filler word
    assert "| mars |" in (out / "table.md").read_text()
    # The server's cost model is kept with its run; where it learned its step terms in these few seconds,
    # the twin simulated again at them.
    (run_file,) = (out / "smoke" / "runs").glob("mars-r1/run.json")
    cost = json.loads(run_file.read_text())["cost_model"]
    assert cost["step_source"] in ("learned", "placeholder") and cost["seconds_per_iteration"] > 0
    learned = cost["step_source"] == "learned"
    assert ("smoke" in result["served_costs"]) == learned
    assert (record["sim_served"] is not None) == learned
    # The server predicted online from the replies it served (a few tokens each), never from
    # max_tokens (4096), which is all a turn's request holds.
    events = [json.loads(line) for line in (twin_run.folder / "trace.jsonl").read_text().splitlines()]
    predicted = [e["output_tokens"] for e in events if e.get("event") == "predict"]
    assert len(predicted) >= 4 and max(predicted) <= 100


def test_resuming_live_runs_of_other_settings_stops_before_any_simulation(tmp_path, capsys, monkeypatch):
    from marsched.experiments.http_bench.run import RESUME_MISMATCH_EXIT, write_summary
    from marsched.experiments.twin import run as twin_run

    out = tmp_path / "twin"
    argv = ["--model", "m", "--profile", PROFILE, "--out", str(out), "--configs", "mars", "--loads", "queueing:0.5",
            "--duration", "20", "--max-turns", "3", "--token-scale", "0.01", "--resume"]
    earlier = twin_run.live_plan(twin_cli.plan_of(twin_cli.parse(argv + ["--kv-blocks", "300"])),
                                 Load("queueing", 0.5), replace(LOAD, rate=0.5))
    write_summary(earlier, [])

    def no_simulation(*args, **kwargs):
        raise AssertionError("simulated before the check")

    monkeypatch.setattr(twin_run.Simulations, "summary", no_simulation)
    assert twin_cli.main(argv) == RESUME_MISMATCH_EXIT
    assert "STOPPED: --resume: the runs in" in capsys.readouterr().err
    assert not (out / "records.json").exists()

"""The twin at the step costs the live servers learned (`experiments/twin/served_costs.py`): the median
of the learned terms, the cost model with them, their step time against the profile's, the simulation
and the table at them."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from marsched.experiments.twin.records import Load, TwinRecord, markdown
from marsched.experiments.twin.served_costs import (
    REFERENCE_STEPS, costs_by_config, served_terms, step_time_ratio, with_served_terms,
)
from marsched.experiments.twin.simulate import SimEngine, engine_profile, simulate
from marsched.experiments.twin.stream import replayed_requests
from marsched.loadgen.options import CLAUDE_CODE, LoadgenOptions
from marsched.policy.cost_model import CostModel
from marsched.policy.learned_cost import STEP_TERM_NAMES

PROFILE_COST = CostModel(seconds_per_token=7e-6, seconds_per_iteration=2e-3, token_budget=4096,
                         swap_tokens_per_s=1e7, seconds_per_context_token=5e-8, seconds_per_sequence=3e-4,
                         seconds_per_attention_pair=1.4e-8)


def _learned(scale: float, step_source: str = "learned", swap_source: str = "learned") -> dict:
    terms = {name: scale * getattr(PROFILE_COST, name) for name in STEP_TERM_NAMES}
    return terms | {"step_source": step_source, "swap_source": swap_source, "swap_tokens_per_s": scale * 1e6,
                    "token_budget": 4096, "steps": 500}


def test_the_servers_terms_are_the_median_over_the_runs_that_learned_them():
    terms = served_terms([_learned(1.0), _learned(3.0), _learned(2.0), None,
                          _learned(100.0, step_source="placeholder", swap_source="placeholder")])
    assert terms["runs"] == 3
    for name in STEP_TERM_NAMES:
        assert terms[name] == pytest.approx(2.0 * getattr(PROFILE_COST, name))
    assert terms["swap_tokens_per_s"] == pytest.approx(2e6) and terms["swap_runs"] == 3


def test_the_servers_terms_are_their_whole_runs_fits_where_they_reported_them():
    whole = {name: 3.0 * getattr(PROFILE_COST, name) for name in STEP_TERM_NAMES} | {"steps": 900}
    terms = served_terms([_learned(1.0) | {"run": whole}, _learned(1.0) | {"run": whole}, _learned(1.0) | {"run": None}])
    for name in STEP_TERM_NAMES:  # the median of 3x, 3x and (no whole-run fit: the latest fit's) 1x
        assert terms[name] == pytest.approx(3.0 * getattr(PROFILE_COST, name))
    assert terms["runs"] == 3 and terms["whole_run_fits"] == 2


def test_a_swap_rate_is_taken_only_from_runs_that_learned_one():
    terms = served_terms([_learned(1.0, swap_source="placeholder"), _learned(2.0, swap_source="placeholder")])
    assert "swap_tokens_per_s" not in terms and terms["swap_runs"] == 0
    assert with_served_terms(PROFILE_COST, terms).swap_tokens_per_s == PROFILE_COST.swap_tokens_per_s


def test_no_learned_run_gives_no_terms():
    assert served_terms([]) is None
    assert served_terms([None, _learned(2.0, step_source="placeholder"), _learned(2.0, step_source="profile")]) is None


def test_each_configuration_takes_its_own_runs_terms_and_stock_vllm_the_vllm_policys():
    runs = [("mars", _learned(1.0)), ("mars", _learned(3.0)), ("infercept", _learned(4.0)), ("vllm", _learned(5.0)),
            ("vllm-stock", None), ("autellix", _learned(9.0, step_source="placeholder"))]
    costs = costs_by_config(runs, ["mars", "infercept", "vllm-stock", "vllm-stock-host", "autellix"])
    seq = PROFILE_COST.seconds_per_sequence
    assert costs["mars"]["seconds_per_sequence"] == pytest.approx(2.0 * seq) and costs["mars"]["runs"] == 2
    assert costs["infercept"]["seconds_per_sequence"] == pytest.approx(4.0 * seq)
    assert costs["mars"]["from_runs_of"] == "mars" and costs["infercept"]["from_runs_of"] == "infercept"
    for stock in ("vllm-stock", "vllm-stock-host"):  # the marsched server closest to stock vLLM stands in
        assert costs[stock]["seconds_per_sequence"] == pytest.approx(5.0 * seq) and costs[stock]["from_runs_of"] == "vllm"
    # Nothing of its own and no stand-in: the median of the four runs that learned.
    assert costs["autellix"]["seconds_per_sequence"] == pytest.approx(3.5 * seq) and costs["autellix"]["runs"] == 4
    assert costs["autellix"]["from_runs_of"] == "all"
    without_vllm = costs_by_config(runs[:3], ["vllm-stock"])
    assert without_vllm["vllm-stock"]["from_runs_of"] == "all" and without_vllm["vllm-stock"]["runs"] == 3
    assert costs_by_config([("vllm-stock", None)], ["vllm-stock"]) is None


def test_stock_vllm_with_its_step_meters_terms_takes_its_own():
    runs = [("vllm", _learned(5.0)), ("vllm-stock", _learned(2.0, swap_source="placeholder")),
            ("vllm-stock", _learned(4.0, swap_source="placeholder")), ("vllm-stock-host", None)]
    costs = costs_by_config(runs, ["vllm-stock", "vllm-stock-host"])
    seq = PROFILE_COST.seconds_per_sequence
    assert costs["vllm-stock"]["from_runs_of"] == "vllm-stock" and costs["vllm-stock"]["runs"] == 2
    assert costs["vllm-stock"]["seconds_per_sequence"] == pytest.approx(3.0 * seq)
    assert costs["vllm-stock-host"]["from_runs_of"] == "vllm"  # no meter in its run: the stand-in


def test_the_cost_model_takes_the_servers_terms_and_keeps_its_budget():
    served = with_served_terms(PROFILE_COST, served_terms([_learned(2.0)]))
    assert served.seconds_per_sequence == pytest.approx(6e-4) and served.seconds_per_iteration == pytest.approx(4e-3)
    assert served.swap_tokens_per_s == pytest.approx(2e6)
    assert served.token_budget == PROFILE_COST.token_budget


def test_the_step_time_ratio_is_the_servers_over_the_profiles_at_the_reference_steps():
    assert step_time_ratio(PROFILE_COST, with_served_terms(PROFILE_COST, served_terms([_learned(2.0)]))) == pytest.approx(2.0)
    assert step_time_ratio(PROFILE_COST, PROFILE_COST) == pytest.approx(1.0)
    # Only the per-sequence term slower: decode batches of eight feel it most, one long chunk least.
    slower = replace(PROFILE_COST, seconds_per_sequence=10 * PROFILE_COST.seconds_per_sequence)
    ratio = step_time_ratio(PROFILE_COST, slower)
    assert 1.0 < ratio < 10.0
    assert {step.sequences for step in REFERENCE_STEPS} == {1, 8}


def test_the_simulator_at_slower_step_costs_predicts_slower_tasks():
    load = LoadgenOptions("http://127.0.0.1:1", CLAUDE_CODE, None, 0.5, 20.0, 3, 0.1, 2.0, 0.01, 3)
    engine = SimEngine("results/twin/profile.json", 257, 64, 4096)
    requests = replayed_requests(load)
    at_profile = simulate("mars", load, engine, 1.0, requests)
    fast = simulate("mars", load, engine, 1.0, requests, served_terms([_learned(1.0)]))
    slow = simulate("mars", load, engine, 1.0, requests, served_terms([_learned(50.0)]))
    assert fast["e2e_mean_s"] < slow["e2e_mean_s"]
    assert at_profile["num_finished"] == slow["num_finished"] == len(requests)


def test_the_table_adds_the_comparison_at_the_servers_step_costs_where_they_learned_them():
    queueing = Load("queueing", 1.0)
    records = [TwinRecord("mars", queueing, 1, {"e2e_mean_s": 10.0, "e2e_p99_s": 20.0},
                          {"e2e_mean_s": 13.0, "e2e_p99_s": 26.0}, None, {"e2e_mean_s": 12.5, "e2e_p99_s": 25.0})]
    served = {"queueing": {"mars": {"step_time_ratio": 1.57, "from_runs_of": "mars"},
                           "vllm-stock": {"step_time_ratio": 1.42, "from_runs_of": "vllm"}}}
    table = markdown(records, served)
    assert "| mars | 10.00 | 13.00 | 1.30 ✗ |" in table
    assert ("#### queueing, simulated at the servers' step costs (1.42–1.57× the profile's step time; each "
            "configuration's own runs', vllm-stock's from vllm's)") in table
    assert "| mars | 12.50 | 13.00 | 1.04 ✓ |" in table
    assert "the fit decided with" not in table  # no run counts: nothing to say
    served["queueing"]["mars"] |= {"runs": 3, "whole_run_fits": 1}
    served["queueing"]["vllm-stock"] |= {"runs": 3, "whole_run_fits": 3}
    assert "vllm-stock's from vllm's; the fit decided with, not the whole run's, for mars)" in markdown(records, served)
    assert "servers' step costs" not in markdown(records)  # no terms, no second table
    bare = [replace(records[0], sim_served=None)]
    assert "servers' step costs" not in markdown(bare, served)


def _run_file(folder, config: str, repeat: int, cost_model: dict | None, measured: bool = True) -> None:
    from marsched.experiments.http_bench.records import RunRecord

    run = folder / "runs" / f"{config}-r{repeat}"
    run.mkdir(parents=True)
    record = RunRecord(config, repeat, loadgen=str(run / "loadgen.json") if measured else None, cost_model=cost_model)
    (run / "run.json").write_text(json.dumps(record.to_dict()))


def test_a_loads_step_costs_are_read_from_its_measured_marsched_runs(tmp_path, capsys):
    from marsched.experiments.twin import __main__ as twin_cli
    from marsched.experiments.twin.run import load_runs, servers_step_costs

    argv = ["--model", "m", "--profile", "results/twin/profile.json", "--out", str(tmp_path), "--repeats", "2"]
    plan = twin_cli.plan_of(twin_cli.parse(argv))
    profile_cost = engine_profile(plan.sim_engine).cost
    sims = {"mars": {}, "vllm-stock": {}, "infercept": {}}
    learned = {name: 2.0 * getattr(profile_cost, name) for name in STEP_TERM_NAMES}
    _run_file(tmp_path, "mars", 1, learned | {"step_source": "learned", "swap_source": "placeholder"})
    _run_file(tmp_path, "infercept", 1, {n: 100 * v for n, v in learned.items()} | {"step_source": "learned"},
              measured=False)  # a run that did not measure counts nothing
    _run_file(tmp_path, "mars", 3, {n: 100 * v for n, v in learned.items()} | {"step_source": "learned"})  # past --repeats
    _run_file(tmp_path, "vllm-stock", 1, None)
    costs = servers_step_costs(plan, Load("queueing", 1.0), load_runs(plan, sims, tmp_path))
    assert set(costs) == set(plan.configs)
    for config in ("mars", "vllm-stock", "infercept"):  # mars its own; the others, none of their own, the same
        assert costs[config]["runs"] == 1 and costs[config]["step_time_ratio"] == pytest.approx(2.0)
    assert costs["mars"]["from_runs_of"] == "mars" and costs["infercept"]["from_runs_of"] == "all"
    err = capsys.readouterr().err
    assert "the servers' steps took 2.00-2.00x the profile's" in err and "WARNING" in err
    (tmp_path / "runs" / "mars-r1" / "run.json").unlink()
    assert servers_step_costs(plan, Load("queueing", 1.0), load_runs(plan, sims, tmp_path)) is None

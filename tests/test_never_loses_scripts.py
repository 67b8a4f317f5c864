"""scripts/never_loses.sh, never_loses_sets.py and never_loses_tables.py: the run sets reach the shell
intact, the seed sweep runs what it says, and its table computes the ratios and medians."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from marsched.experiments import never_loses_sets, never_loses_tables

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


@pytest.fixture(scope="module")
def sets():
    return never_loses_sets


@pytest.fixture(scope="module")
def tables():
    return never_loses_tables


@pytest.mark.parametrize("name", ["gptj", "calibrated"])
def test_the_shell_reads_each_run_set_as_python_holds_it(sets, name):
    shown = subprocess.run(
        ["bash", "-c", 'eval "$1"; echo "$profile|$out|${loads[single]}|${loads[agent]}|${top[multi]}|${seeds[*]}|'
                       '${multiples[*]}|${ages[*]}"',
         "_", sets.shell(name)], capture_output=True, text=True, check=True).stdout.strip()
    s = sets.RUN_SETS[name]
    assert shown == "|".join([s.profile, f"results/{s.folder}", ",".join(f"{q:g}" for q in s.loads["single"]),
                              ",".join(f"{q:g}" for q in s.loads["agent"]), f"{s.top['multi']:g}",
                              " ".join(map(str, sets.SEEDS)), " ".join(f"{m:g}" for m in sets.FRONTIER_MULTIPLES),
                              " ".join(f"{a:g}" for a in sets.FRONTIER_AGES_S)])
    assert all(s.top[t] == max(s.loads[t]) for t in sets.TRACES)  # the most loaded point is the range's end


def _recorded(tmp_path, *args: str) -> list[str]:
    """The marsched command lines never_loses.sh runs with these arguments (nothing is simulated)."""
    calls = tmp_path / "calls"
    recorder = tmp_path / "marsched"
    recorder.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    recorder.chmod(0o755)
    env = {**os.environ, "MARSCHED": str(recorder), "PYTHON": sys.executable}
    subprocess.run(["bash", str(SCRIPTS / "never_loses.sh"), *args], env=env, check=True, capture_output=True, text=True)
    return calls.read_text().splitlines()


def test_the_seed_sweep_runs_four_commands_per_trace_and_seed(sets, tmp_path):
    lines = _recorded(tmp_path, "calibrated", "--seeds")
    assert len(lines) == 4 * len(sets.TRACES) * len(sets.SEEDS)
    s = sets.RUN_SETS["calibrated"]
    agent_seed3 = [line for line in lines if "--trace agent " in line and "--seed 3 " in line]
    assert all(f"--profile {s.profile} " in line and f"--qps {s.top['agent']:g} " in line for line in agent_seed3)
    assert {line.split("--json ")[1] for line in agent_seed3} == {
        f"results/{s.folder}/seeds/agent-{kind}seed3.json" for kind in ("", "off-", "sjf-", "bound-")}
    assert any("--policies mars --predictor foreknowledge" in line for line in agent_seed3)
    assert any("--policies mars --starvation off" in line for line in agent_seed3)
    assert any("--policies sjf --admission predicted-peak" in line for line in agent_seed3)
    assert any("--policies infercept,mars " in line for line in agent_seed3)


def test_every_variant_on_the_frontier_table_is_run_at_the_most_loaded_point(sets, tables, tmp_path):
    lines = _recorded(tmp_path)  # the GPT-J set, everything but the seed sweep
    s = sets.RUN_SETS["gptj"]
    for trace in sets.TRACES:
        written = {line.split("--json ")[1].split()[0] for line in lines
                   if f"--trace {trace} " in line and f"{s.top[trace]:g}" in line.split("--qps ")[1].split()[0].split(",")}
        assert {f"results/{s.folder}/{trace}-{name}.json" for _, name in tables.frontier_variants()} <= written
    labels = [label for label, _ in tables.frontier_variants()]
    assert labels[:8] == ["fcfs-wait:0.8", "fcfs-wait:1", "fcfs-wait:1.25", "fcfs-wait:1.5", "fcfs-wait:2 (default)",
                          "fcfs-wait:3", "fcfs-wait:4", "age 15 s"]  # the README's column order


def test_the_script_refuses_what_it_does_not_know():
    result = subprocess.run(["bash", str(SCRIPTS / "never_loses.sh"), "calibratd"], capture_output=True, text=True)
    assert result.returncode == 2 and "usage:" in result.stderr


def test_the_sets_script_prints_the_shell_assignments(sets):
    shown = subprocess.run([sys.executable, str(SCRIPTS / "never_loses_sets.py"), "calibrated"], capture_output=True,
                           text=True, check=True).stdout
    assert shown == sets.shell("calibrated")
    refused = subprocess.run([sys.executable, str(SCRIPTS / "never_loses_sets.py"), "nope"], capture_output=True,
                             text=True)
    assert refused.returncode == 1 and "usage: never_loses_sets.py gptj|calibrated" in refused.stderr


def test_the_tables_script_refuses_a_trace_it_does_not_know():
    # (Run on a known trace it would rewrite the results folder's frontier.png.)
    refused = subprocess.run([sys.executable, str(SCRIPTS / "never_loses_tables.py"), "calibrated", "singel"],
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode == 1 and "unknown: singel (traces: single, multi, agent)" in refused.stderr


def test_the_seeds_table_divides_by_the_same_seeds_infercept_and_takes_medians(tables, tmp_path, capsys):
    results = tables.SetResults(tmp_path, "test", {"agent": 2.0}, seeds=(0, 1, 2))
    (tmp_path / "seeds").mkdir()

    def write(name, policy, mean, p99):
        path = tmp_path / "seeds" / f"{name}.json"
        records = json.loads(path.read_text()) if path.exists() else []
        records.append({"policy": policy, "qps": 2.0, "e2e_mean_s": mean, "e2e_p99_s": p99})
        path.write_text(json.dumps(records))

    for seed, infercept in enumerate((100.0, 200.0, 400.0)):
        write(f"agent-seed{seed}", "infercept", infercept, 10 * infercept)
        write(f"agent-seed{seed}", "mars", 0.5 * infercept * (1 + seed**2 / 10), 10 * infercept)
        write(f"agent-off-seed{seed}", "mars", 0.4 * infercept, 20 * infercept)
        write(f"agent-sjf-seed{seed}", "sjf", 0.45 * infercept, 15 * infercept)
        write(f"agent-bound-seed{seed}", "mars", 0.3 * infercept, 9 * infercept)
    tables.seeds_table(results, ["agent"])
    out = capsys.readouterr().out
    assert "| agent 2 qps | 2 | 400.0 | 0.700 / 1.00 | 0.400 / 2.00 | 0.450 / 1.50 | 0.300 / 0.90 |" in out
    assert "| agent 2 qps | median of 3 | | 0.550 / 1.00 | 0.400 / 2.00 | 0.450 / 1.50 | 0.300 / 0.90 |" in out
    assert "agent 0.30" in out  # the bundled agent trace's size spread, as the README quotes it


def test_the_main_table_shows_the_bound_beside_mars_never_as_it(tables, tmp_path, capsys):
    results = tables.SetResults(tmp_path, "test", {"agent": 2.0})
    rows = {"agent-main": [("vllm", 300.0, 900.0), ("infercept", 200.0, 800.0), ("mars", 150.0, 880.0)],
            "agent-bound": [("mars", 100.0, 720.0)]}
    for name, records in rows.items():
        (tmp_path / f"{name}.json").write_text(json.dumps([
            {"policy": p, "qps": 2.0, "e2e_mean_s": m, "e2e_p99_s": q, "max_queue_wait_s": 5.0} for p, m, q in records]))
    tables.main_table(results, "agent")
    out = capsys.readouterr().out
    assert "| 2 | 300.0 / 900 | 200.0 / 800 | 150.0 / 880 | 0.75 | 1.10 | 5.0 |  |  | 0.50 / 0.90 |" in out

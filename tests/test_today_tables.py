"""The per-set tables of docs/results.md (`marsched.experiments.today_tables`)."""

from __future__ import annotations

import json

from marsched.experiments import today_tables
from marsched.experiments.today_frontier import TodaySet
from marsched.experiments.today_tables import ROWS, set_table


def rec(policy: str, qps: float, mean: float, p99: float, ttft: float = 1.0, wait: float = 0.0,
        finished: int = 10) -> dict:
    return {"policy": policy, "qps": qps, "e2e_mean_s": mean, "e2e_p99_s": p99, "ttft_mean_s": ttft,
            "max_queue_wait_s": wait, "num_requests": 10, "num_finished": finished}


def test_a_sets_table_has_every_policy_and_mars_over_the_best_other_by_each_metric():
    s = TodaySet("t", "agent", "llama3-8b-h100", (1, 2), 0.5)
    records = [rec(p, q, 100.0, 100.0) for p in ROWS for q in s.loads if p not in ("mars", "infercept", "vllm-v0")]
    records += [rec("vllm-v0", 1, 1.0, 1.0), rec("vllm-v0", 2, 1.0, 1.0)]  # reference only: never the best other
    records += [rec("infercept", 1, 20.0, 80.0), rec("infercept", 2, 40.0, 300.0)]
    records += [rec("mars", 1, 10.0, 88.0, ttft=0.123, wait=7.4), rec("mars", 2, 30.0, 120.0, wait=61.6, finished=9)]
    lines = set_table(s, records).splitlines()
    assert lines[0] == "**agent, llama3-8b-h100**, tokens × 0.5: e2e mean / p99 (s), TTFT mean (s)"
    assert lines[2] == "| policy | 1 qps | 2 qps |"
    assert [line.split(" |")[0] for line in lines[4:12]] == [f"| {p}" for p in ROWS]
    assert "| mars | 10.0 / 88, 0.12 | 30.0 / 120, 1 |" in lines
    # p99 at 1 qps: infercept's 80 is the best; at 2 qps every other but infercept has 100.
    assert "| mars ÷ best other, mean | 0.50 (infercept) | 0.75 (infercept) |" in lines
    assert "| mars ÷ best other, p99 | 1.10 (infercept) | 1.20 (vllm) |" in lines
    assert lines[-1] == "Longest queue wait under mars: 62 s; requests unserved in all runs: 1."
    with_bound = set_table(s, records, [rec("mars", 1, 5.0, 70.0)]).splitlines()
    assert "| bound: mars told the future | 5.0 / 70, 1 | – |" in with_bound
    assert "| bound ÷ best other, mean | 0.25 | – |" in with_bound
    assert not any(line.startswith("| bound") for line in lines)


def test_it_names_an_unknown_set_and_a_missing_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(today_tables, "ROOT", tmp_path)
    assert today_tables.main(["no-such-set"]) == 2
    assert "no set no-such-set" in capsys.readouterr().err
    assert today_tables.main([]) == 1
    assert "commands.sh" in capsys.readouterr().err
    (tmp_path / "agent-gptj-6b-a100.json").write_text(json.dumps([rec("mars", 0.1, 1, 1)]))
    assert today_tables.main(["agent-gptj-6b-a100"]) == 1
    assert "agent-gptj-6b-a100.json: KeyError" in capsys.readouterr().err

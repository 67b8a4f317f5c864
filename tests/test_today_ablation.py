"""The ablation against today's baselines (`marsched.experiments.today_ablation`): every row at
each set's most loaded point, over INFERCEPT's mean and p99 there."""

from __future__ import annotations

import json

from marsched.experiments import today_ablation
from marsched.experiments.today_ablation import ROWS, RUNS, records_at_top, table
from marsched.experiments.today_frontier import SETS


def rec(policy: str, qps: float, mean: float, p99: float) -> dict:
    return {"policy": policy, "qps": qps, "e2e_mean_s": mean, "e2e_p99_s": p99}


def write_sets(folder) -> None:
    """Every set: the baselines at two loads (the lower one must not be read), the runs at the top."""
    (folder / "ablation").mkdir()
    (folder / "bound").mkdir()
    for s in SETS:
        top, low = s.loads[-1], s.loads[0]
        own = [rec(p, q, 10.0 * k, 20.0 * k) for q in (low, top)
               for k, p in enumerate(("infercept", "vllm", "vllm-offload", "continuum", "autellix", "mars"), 1)]
        own += [rec("infercept", low, 1.0, 1.0)]  # a duplicate at the low load: ignored
        (folder / f"{s.name}.json").write_text(json.dumps(own))
        bound = [rec("mars", top, 2.5, 10.0), rec("mars", low, 1.0, 1.0)]  # the low load last: not read
        (folder / "bound" / f"{s.name}.json").write_text(json.dumps(bound))
        for _, suffix, _ in RUNS:
            policies = ("preserve", "discard", "swap", "sjf") if suffix == "policies" else ("mars",)
            (folder / "ablation" / f"{s.name}-{suffix}.json").write_text(
                json.dumps([rec(p, top, 5.0, 40.0) for p in policies]))


def test_every_row_is_read_at_the_top_load_and_over_infercepts(tmp_path):
    write_sets(tmp_path)
    by_set = records_at_top(tmp_path)
    assert set(by_set) == {s.name for s in SETS}
    for rows in by_set.values():
        assert set(ROWS) <= set(rows)
        # the variants' runs are labelled by what they change, not by their policy (all "mars")
        assert rows["mars"]["e2e_mean_s"] == 60.0 and rows["mars, greedy admission"]["e2e_mean_s"] == 5.0
    lines = table(by_set).splitlines()
    assert lines[0].startswith("| mean / p99 over INFERCEPT's | claude-code-llama3-8b-h100, 4 qps |")
    assert lines[2 + ROWS.index("infercept")] == "| infercept |" + " 1.00 / 1.00 |" * len(SETS)
    assert lines[2 + ROWS.index("vllm")] == "| vllm |" + " 2.00 / 2.00 |" * len(SETS)
    assert lines[2 + ROWS.index("sjf")] == "| sjf |" + " 0.50 / 2.00 |" * len(SETS)
    assert lines[2 + ROWS.index(today_ablation.BOUND)] == f"| {today_ablation.BOUND} |" + " 0.25 / 0.50 |" * len(SETS)


def test_a_set_without_its_bound_has_an_empty_bound_cell(tmp_path):
    write_sets(tmp_path)
    (tmp_path / "bound" / f"{SETS[0].name}.json").unlink()
    lines = table(records_at_top(tmp_path)).splitlines()
    assert lines[2 + ROWS.index(today_ablation.BOUND)].startswith(f"| {today_ablation.BOUND} |  | 0.25 / 0.50 |")


def test_the_command_says_what_to_run_first(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(today_ablation, "ROOT", tmp_path)
    assert today_ablation.main([]) == 1
    assert "today_ablation run" in capsys.readouterr().err
    assert today_ablation.main(["table"]) == 2
    assert today_ablation.main(["run", "no-such-set"]) == 2
    assert "no set no-such-set; the sets: claude-code-llama3-8b-h100," in capsys.readouterr().err


def test_a_set_without_all_its_runs_is_left_out_of_the_table_and_named(tmp_path, monkeypatch, capsys):
    write_sets(tmp_path)
    left_out = SETS[3]
    (tmp_path / "ablation" / f"{left_out.name}-{RUNS[-1][1]}.json").unlink()
    monkeypatch.setattr(today_ablation, "ROOT", tmp_path)
    assert today_ablation.main([]) == 0
    out = capsys.readouterr().out
    header = out.splitlines()[0]
    assert left_out.name not in header and all(f"{s.name}, " in header for s in SETS if s is not left_out)
    assert out.rstrip().endswith(f"(no ablation runs for {left_out.name})")


def test_run_runs_the_named_sets_only(monkeypatch, tmp_path):
    ran = []
    monkeypatch.setattr(today_ablation, "ROOT", tmp_path)
    monkeypatch.setattr(today_ablation, "run_compares", lambda todo: ran.extend(c.out.name for c in todo))
    assert today_ablation.main(["run", SETS[2].name]) == 0
    assert ran == [f"{SETS[2].name}-{suffix}.json" for _, suffix, _ in RUNS]

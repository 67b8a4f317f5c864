"""The knowledge-boundary tables: MARS and the bound against the best other policy per load."""

import json

import pytest

from marsched.experiments.knowable_tables import main, set_rows, tables


def _record(policy, qps, mean, p99, bound=False):
    return {"policy": policy, "qps": qps, "e2e_mean_s": mean, "e2e_p99_s": p99, "bound": bound}


def test_rows_divide_by_the_best_other_policy_per_metric():
    records = [_record("vllm", 1, 100.0, 200.0), _record("infercept", 1, 80.0, 300.0), _record("mars", 1, 40.0, 250.0)]
    [row] = set_rows(records, [_record("mars", 1, 20.0, 240.0, bound=True)])
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells == ["1", "infercept 80.0 / 300", "40.0 / 250", "0.50", "1.25 (vllm)", "20.0 / 240", "0.25"]


def test_a_mars_run_that_read_the_future_is_refused():
    with pytest.raises(ValueError, match="is a bound"):
        set_rows([_record("vllm", 1, 1.0, 1.0), _record("mars", 1, 1.0, 1.0, bound=True)], [])


def test_tables_pair_each_set_with_its_bound(tmp_path, capsys):
    (tmp_path / "agent.json").write_text(json.dumps([_record("vllm", 2, 10.0, 20.0), _record("mars", 2, 5.0, 20.0)]))
    (tmp_path / "agent-bound.json").write_text(json.dumps([_record("mars", 2, 4.0, 19.0, bound=True)]))
    text = tables(tmp_path)
    assert "**agent**" in text and "**agent-bound**" not in text and "| 4.0 / 19 | 0.40 |" in text
    assert main([str(tmp_path / "missing")]) == 2 and "no such directory" in capsys.readouterr().err

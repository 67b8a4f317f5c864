"""The bounded-overtaking table: mars-boost per γ against MARS and the best other policy."""

import json

from marsched.experiments.boost_tables import main, ratio_cells, tables


def _rec(policy, qps, mean, p99, slow):
    return {"policy": policy, "qps": qps, "e2e_mean_s": mean, "e2e_p99_s": p99, "slowdown_p99": slow}


def test_each_metric_is_divided_by_its_own_best_other():
    others = [_rec("vllm", 1, 10.0, 40.0, 8.0), _rec("infercept", 1, 20.0, 20.0, 4.0), _rec("mars", 1, 1.0, 1.0, 1.0)]
    assert ratio_cells(_rec("mars-boost", 1, 5.0, 30.0, 2.0), others) == "0.50 / 1.50 / 0.50"


def test_tables_read_each_gamma_and_the_sets_other_runs(tmp_path, capsys):
    boost, knowable = tmp_path / "boost", tmp_path / "knowable"
    boost.mkdir(), knowable.mkdir()
    (knowable / "multi.json").write_text(json.dumps([_rec("infercept", 2, 10.0, 10.0, 10.0),
                                                      _rec("mars", 2, 5.0, 12.0, 6.0)]))
    for gamma, mean in (("0.01", 8.0), ("0.001", 6.0)):
        (boost / f"multi-g{gamma}.json").write_text(json.dumps([_rec("mars-boost", 2, mean, 9.0, 5.0)]))
    text = tables(boost, knowable)
    assert "| qps | mars (fcfs-wait) | boost γ 0.001 | boost γ 0.01 |" in text
    assert "| 2 | 0.50 / 1.20 / 0.60 | 0.60 / 0.90 / 0.50 | 0.80 / 0.90 / 0.50 |" in text
    assert main([str(boost), str(tmp_path / "missing")]) == 2 and "boost_tables" in capsys.readouterr().err

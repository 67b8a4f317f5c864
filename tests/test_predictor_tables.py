"""scripts/predictor_tables.py (marsched.experiments.predictor_tables): the learned predictor's end-to-end table."""

from __future__ import annotations

import json

from marsched.experiments.predictor_tables import print_tables


def test_the_table_has_a_column_per_run_found_and_the_learned_over_oracle_ratio(tmp_path, capsys):
    def write(key, means):
        records = [{"qps": q, "e2e_mean_s": m, "e2e_p99_s": 10 * m, "duration_s": 300.0} for q, m in means.items()]
        (tmp_path / f"e2e-single-{key}.json").write_text(json.dumps(records))

    write("infercept", {5.0: 20.0, 6.0: 40.0})
    write("mars-oracle", {5.0: 10.0, 6.0: 20.0})
    write("mars-learned", {5.0: 12.0, 6.0: 30.0})
    print_tables(tmp_path)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "**single** (mean / p99 end-to-end s; 300 s of arrivals, seed 0)"
    assert lines[2] == "| qps | infercept | mars oracle | mars learned | learned / oracle mean |"
    assert lines[4] == "| 5 | 20.0 / 200 | 10.0 / 100 | 12.0 / 120 | 1.20 |"
    assert lines[5] == "| 6 | 40.0 / 400 | 20.0 / 200 | 30.0 / 300 | 1.50 |"
    assert not any("multi" in line for line in lines)  # no results for the multi-API trace: no table

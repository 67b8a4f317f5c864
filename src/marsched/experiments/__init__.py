"""The experiments behind the published results, one module each; `scripts/` holds their command lines.

- `infercept_curve`: the simulator against INFERCEPT's published GPT-J curve;
- `never_loses_sets`, `never_loses_tables`: the run sets of `scripts/never_loses.sh` and the
  tables made from their results;
- `sim_vs_bench`: the simulator replaying a `marsched bench` run's streams;
- `conversations`: multi-turn tool-calling conversations against three servers;
- `predictor_latency`, `predictor_tables`: the learned length predictor's cost and its
  end-to-end table.
"""

"""The HTTP comparison: stock vLLM and `marsched serve`'s policies under one `marsched loadgen` workload
(`python -m marsched.experiments.http_bench`, `scripts/http_bench.sh`, docs/bench.md).

One module per concept: `configs` (the configurations and their server commands, alike in
everything but the scheduler), `order` (which run comes when: repeats interleaved),
`binding` (the CPU cores each server computes on, which must be the same for all),
`engine_queue` (the engine's waiting and running counts, sampled during a run), `summary` (the
medians over repeats, their spread, the ratios, the Markdown table), `run` (a run: start the
server, replay, stop the group; the whole plan, Ctrl-C) and `__main__` (the command line).
"""

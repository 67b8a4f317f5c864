"""The simulator against a `marsched bench` run: the same requests on a profile, side by side.

For every record of the bench run, the simulator replays the stream that point replayed (the
trace, seed, rate, duration, token and API-time scales and context limit of the record) with
the record's policy, on the profile with its device KV blocks set to what the bench's engine
had (`simulate_point`). `comparison` pairs the bench's and the simulator's mean end-to-end
latency with the error, and says whether the two rank the policies in the same order at each
rate. `scripts/sim_vs_bench.py` prints it.
"""

from __future__ import annotations

from dataclasses import replace

from marsched.bench.runner import RunSpec
from marsched.bench.stream import bench_requests
from marsched.metrics.records import summarize
from marsched.predict.length import prepare_length_predictor
from marsched.sim.select import make_simulator
from marsched.workload.loader import load_trace


def simulate_point(record: dict, profile_path: str) -> dict:
    """The simulator's summary for the stream one bench record replayed."""
    # Records name the segment predictor as LENGTH+api:ESTIMATOR.
    length, _, estimator = record.get("predictor", "oracle+api:type-mean").partition("+api:")
    starvation = record.get("starvation", "default")
    if record.get("starvation_fcfs_multiple") is not None:
        starvation = f"{starvation}:{record['starvation_fcfs_multiple']}"
    spec = RunSpec(policy=record["policy"], qps=record["qps"], trace=record["trace"], profile=profile_path,
                   duration_s=record["duration_s"], seed=record["seed"], predictor=length,
                   api_estimator=estimator or "type-mean", starvation=starvation,
                   starvation_threshold=record.get("starvation_threshold", "default"),
                   prefix_cache=False)  # `marsched bench` runs vLLM with prefix caching off
    profile, policy = spec.build()
    kv = record["kv_cache"]
    profile = replace(profile, device_blocks=kv["blocks"], block_tokens=kv["block_tokens"],
                      max_sequences=kv.get("max_num_seqs", profile.max_sequences),
                      cost=replace(profile.cost, token_budget=kv["max_num_batched_tokens"]))
    templates = load_trace(record["trace"])
    prepare_length_predictor(policy.predictor.length, templates, record["trace"])  # as run_one does
    # The bench's stream, cut where the bench cut it (`--max-requests`): it ran `num_requests`.
    requests = bench_requests(templates, record["qps"], record["duration_s"], record["seed"], record["token_scale"],
                              kv["max_model_len"], record["api_time_scale"], record["num_requests"])
    result = make_simulator(requests, profile, policy).run()
    return summarize(result.records)


def comparison(records: list[dict], profile: str) -> tuple[list[dict], dict[float, dict]]:
    """(rows, orders): a row per complete bench point with the simulator's latencies and the error, and
    per rate the policies in the order of the bench's and the simulator's mean latency."""
    rows = []
    for record in records:
        if record.get("partial") or record.get("engine") != "vllm":
            continue
        sim = simulate_point(record, profile)
        rows.append({"qps": record["qps"], "policy": record["policy"], "bench_e2e_mean_s": record["e2e_mean_s"],
                     "sim_e2e_mean_s": sim["e2e_mean_s"], "bench_e2e_p99_s": record["e2e_p99_s"],
                     "sim_e2e_p99_s": sim["e2e_p99_s"],
                     "error": sim["e2e_mean_s"] / record["e2e_mean_s"] - 1})
    orders = {}
    for qps in sorted({r["qps"] for r in rows}):
        at = [r for r in rows if r["qps"] == qps]
        bench_order = [r["policy"] for r in sorted(at, key=lambda r: r["bench_e2e_mean_s"])]
        sim_order = [r["policy"] for r in sorted(at, key=lambda r: r["sim_e2e_mean_s"])]
        orders[qps] = {"bench": bench_order, "sim": sim_order, "same": bench_order == sim_order}
    return rows, orders


def comparison_lines(rows: list[dict], orders: dict[float, dict]) -> list[str]:
    """The Markdown table of the rows, then a line per rate with the two orders."""
    lines = ["| qps | policy | bench mean s | sim mean s | error | bench p99 s | sim p99 s |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['qps']:g} | {r['policy']} | {r['bench_e2e_mean_s']:.2f} | {r['sim_e2e_mean_s']:.2f} | "
                     f"{r['error']:+.0%} | {r['bench_e2e_p99_s']:.2f} | {r['sim_e2e_p99_s']:.2f} |")
    for qps, order in orders.items():
        lines.append(f"qps {qps:g}: bench order {' < '.join(order['bench'])}; simulator {' < '.join(order['sim'])}"
                     f"{'' if order['same'] else '  (differs)'}")
    return lines

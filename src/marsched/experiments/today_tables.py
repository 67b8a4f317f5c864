"""The per-set tables of docs/results.md, "Against today's baselines": every policy's mean and p99
end-to-end latency and mean TTFT at each load of a set of results/today/commands.sh, and MARS over
the best other policy at each load (by mean, and by p99 on its own).

    python -m marsched.experiments.today_tables          every set whose runs are there
    python -m marsched.experiments.today_tables SET...   those sets (results/today/<SET>.json)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from marsched.experiments.today_frontier import ROOT, SETS, TodaySet, best_other, others_of, sets_named

ROWS = ("vllm-v0", "vllm", "vllm-offload", "infercept", "continuum", "continuum-public", "autellix", "mars")


def cell(r: dict) -> str:
    return f"{r['e2e_mean_s']:.1f} / {r['e2e_p99_s']:.0f}, {r['ttft_mean_s']:.2g}"


def set_table(s: TodaySet, records: list[dict], bound: list[dict] | None = None) -> str:
    """The set's table, its longest queue wait under MARS and the requests no run finished. With
    `bound` (MARS told the future, results/today/bound/), a row for it and its ratio, named a bound."""
    at = {(r["policy"], r["qps"]): r for r in records}
    scale = f", tokens × {s.token_scale:g}" if s.token_scale != 1 else ""
    lines = [f"**{s.trace}, {s.profile}**{scale}: e2e mean / p99 (s), TTFT mean (s)", "",
             "| policy | " + " | ".join(f"{q:g} qps" for q in s.loads) + " |",
             "| --- |" + " ---: |" * len(s.loads)]
    for policy in ROWS:
        lines.append(f"| {policy} | " + " | ".join(cell(at[policy, q]) for q in s.loads) + " |")
    others = others_of(records)
    for metric, name in (("e2e_mean_s", "mean"), ("e2e_p99_s", "p99")):
        ratios = []
        for q in s.loads:
            best = best_other(others, q, metric)
            ratios.append(f"{at['mars', q][metric] / best[metric]:.2f} ({best['policy']})")
        lines.append(f"| mars ÷ best other, {name} | " + " | ".join(ratios) + " |")
    if bound:
        told = {r["qps"]: r for r in bound}
        lines.append("| bound: mars told the future | " + " | ".join(cell(told[q]) if q in told else "–" for q in s.loads)
                     + " |")
        lines.append("| bound ÷ best other, mean | " + " | ".join(
            f"{told[q]['e2e_mean_s'] / best_other(others, q, 'e2e_mean_s')['e2e_mean_s']:.2f}" if q in told else "–"
            for q in s.loads) + " |")
    wait = max(at["mars", q]["max_queue_wait_s"] for q in s.loads)
    unserved = sum(r["num_requests"] - r["num_finished"] for r in records)
    lines += ["", f"Longest queue wait under mars: {wait:.0f} s; requests unserved in all runs: {unserved}."]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    try:
        named = sets_named(argv)
    except ValueError as e:
        print(f"today_tables: {e}", file=sys.stderr)
        return 2
    chosen = list(named) or [s for s in SETS if (ROOT / f"{s.name}.json").exists()]
    if not chosen:
        print(f"today_tables: no results in {ROOT}: run results/today/commands.sh first", file=sys.stderr)
        return 1
    for s in chosen:
        path = ROOT / f"{s.name}.json"
        try:
            records = json.loads(path.read_text())
            bound_path = ROOT / "bound" / f"{s.name}.json"
            bound = json.loads(bound_path.read_text()) if bound_path.exists() else None
            print(set_table(s, records, bound) + "\n")
        except (OSError, ValueError, KeyError) as e:
            print(f"today_tables: {path}: {type(e).__name__}: {e} (rerun its line of results/today/commands.sh)",
                  file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The tables of docs/results.md, "The knowledge boundary": per set and load, the best other
policy's mean and p99, MARS knowing only the past (the default) and MARS told the future
(`--predictor foreknowledge`, a bound), with their ratios to the best other
(results/knowable/commands.sh writes the runs).

    python -m marsched.experiments.knowable_tables [DIR]     DIR: results/knowable by default
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

BOUND_SUFFIX = "-bound.json"


def best_other(records: list[dict], qps: float, metric: str) -> dict:
    """The policy other than MARS with the lowest `metric` at `qps`."""
    others = [r for r in records if r["qps"] == qps and r["policy"] != "mars"]
    if not others:
        raise ValueError(f"no policy but mars ran at {qps:g} qps")
    return min(others, key=lambda r: r[metric])


def set_rows(records: list[dict], bound: list[dict]) -> list[str]:
    """One row per load: the best other, MARS, the bound, and MARS's and the bound's ratios."""
    mars = {r["qps"]: r for r in records if r["policy"] == "mars"}
    told = {r["qps"]: r for r in bound}
    rows = []
    for qps in sorted(mars):
        m, b = mars[qps], told.get(qps)
        if m["bound"]:
            raise ValueError(f"the mars run at {qps:g} qps read the future: it is a bound, not the default")
        best = best_other(records, qps, "e2e_mean_s")
        best_p99 = best_other(records, qps, "e2e_p99_s")
        bound_cells = (f"{b['e2e_mean_s']:.1f} / {b['e2e_p99_s']:.0f}",
                       f"{b['e2e_mean_s'] / best['e2e_mean_s']:.2f}") if b else ("–", "–")
        rows.append(f"| {qps:g} | {best['policy']} {best['e2e_mean_s']:.1f} / {best['e2e_p99_s']:.0f} | "
                    f"{m['e2e_mean_s']:.1f} / {m['e2e_p99_s']:.0f} | {m['e2e_mean_s'] / best['e2e_mean_s']:.2f} | "
                    f"{m['e2e_p99_s'] / best_p99['e2e_p99_s']:.2f} ({best_p99['policy']}) | "
                    f"{bound_cells[0]} | {bound_cells[1]} |")
    return rows


HEADER = ["| qps | best other by mean: mean / p99 | mars: mean / p99 | mars ÷ best, mean | mars ÷ best, p99 "
          "| bound: mean / p99 | bound ÷ best, mean |", "| --- | --- | --- | ---: | --- | --- | ---: |"]


def tables(directory: Path) -> str:
    out = []
    for path in sorted(directory.glob("*.json")):
        if path.name.endswith(BOUND_SUFFIX):
            continue
        bound_path = path.with_name(path.stem + BOUND_SUFFIX)
        records = json.loads(path.read_text())
        bound = json.loads(bound_path.read_text()) if bound_path.exists() else []
        out += [f"**{path.stem}**", "", *HEADER, *set_rows(records, bound), ""]
    return "\n".join(out)


def main(argv: list[str]) -> int:
    directory = Path(argv[0]) if argv else Path("results/knowable")
    if not directory.is_dir():
        print(f"{directory}: no such directory (run results/knowable/commands.sh first)", file=sys.stderr)
        return 2
    print(tables(directory))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

"""The table of docs/results.md, "Bounded overtaking": mars-boost at each γ of
results/boost/commands.sh against MARS's default and the best other policy of the same set and
load (results/knowable/), by mean, p99 latency and p99 slowdown.

    python -m marsched.experiments.boost_tables [BOOST_DIR [KNOWABLE_DIR]]
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

_NAME = re.compile(r"(?P<set>.+)-g(?P<gamma>[0-9.]+)\.json$")
METRICS = (("e2e_mean_s", "mean"), ("e2e_p99_s", "p99"), ("slowdown_p99", "slowdown p99"))


def best_other(records: list[dict], qps: float, metric: str) -> dict:
    others = [r for r in records if r["qps"] == qps and not r["policy"].startswith("mars") and metric in r]
    if not others:
        raise ValueError(f"no other policy with {metric} ran at {qps:g} qps")
    return min(others, key=lambda r: r[metric])


def ratio_cells(record: dict, others: list[dict]) -> str:
    """`mean ÷ best, p99 ÷ best, slowdown p99 ÷ best` of one run."""
    q = record["qps"]
    return " / ".join(f"{record[m] / best_other(others, q, m)[m]:.2f}" for m, _ in METRICS)


def tables(boost_dir: Path, knowable_dir: Path) -> str:
    runs: dict[str, dict[float, list[dict]]] = {}
    for path in sorted(boost_dir.glob("*.json")):
        match = _NAME.match(path.name)
        if match:
            runs.setdefault(match["set"], {})[float(match["gamma"])] = json.loads(path.read_text())
    out = []
    for name, by_gamma in runs.items():
        others = json.loads((knowable_dir / f"{name}.json").read_text())
        mars = {r["qps"]: r for r in others if r["policy"] == "mars"}
        gammas = sorted(by_gamma)
        out += [f"**{name}**: each cell mean / p99 / p99 slowdown, ÷ the best other's of each", "",
                "| qps | mars (fcfs-wait) | " + " | ".join(f"boost γ {g:g}" for g in gammas) + " |",
                "| --- |" + " --- |" * (len(gammas) + 1)]
        for q in sorted(mars):
            cells = [ratio_cells(mars[q], others)]
            for g in gammas:
                at = {r["qps"]: r for r in by_gamma[g]}
                cells.append(ratio_cells(at[q], others) if q in at else "–")
            out.append(f"| {q:g} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def main(argv: list[str]) -> int:
    boost_dir = Path(argv[0]) if argv else Path("results/boost")
    knowable_dir = Path(argv[1]) if len(argv) > 1 else Path("results/knowable")
    try:
        print(tables(boost_dir, knowable_dir))
    except (OSError, ValueError, KeyError) as error:
        print(f"boost_tables: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

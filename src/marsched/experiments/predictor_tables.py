"""The README's end-to-end table of the learned length predictor: MARS with each predictor against
INFERCEPT, from the results of scripts/predictor_e2e.sh (results/predictor/e2e-*.json)."""

from __future__ import annotations

import json
from pathlib import Path

COLUMNS = [("infercept", "infercept"), ("mars-oracle", "mars oracle"), ("mars-noisy0.3", "mars noisy:0.3"),
           ("mars-type-mean", "mars type-mean"), ("mars-learned", "mars learned")]


def print_tables(folder: Path) -> None:
    """One table per trace with results in `folder` (results/predictor/e2e-TRACE-KEY.json)."""
    for trace in ("single", "multi"):
        runs = {}
        for key, _ in COLUMNS:
            path = folder / f"e2e-{trace}-{key}.json"
            if path.exists():
                runs[key] = {r["qps"]: r for r in json.loads(path.read_text())}
        if not runs:
            continue
        first = next(iter(runs.values()))
        duration = next(iter(first.values()))["duration_s"]
        print(f"**{trace}** (mean / p99 end-to-end s; {duration:g} s of arrivals, seed 0)\n")
        print("| qps | " + " | ".join(label for key, label in COLUMNS if key in runs) + " | learned / oracle mean |")
        print("| --- |" + " --- |" * (len(runs) + 1))
        for qps in sorted(first):
            cells = [f"{runs[k][qps]['e2e_mean_s']:.1f} / {runs[k][qps]['e2e_p99_s']:.0f}" for k, _ in COLUMNS if k in runs]
            ratio = ""
            if "mars-learned" in runs and "mars-oracle" in runs:
                ratio = f"{runs['mars-learned'][qps]['e2e_mean_s'] / runs['mars-oracle'][qps]['e2e_mean_s']:.2f}"
            print(f"| {qps:g} | " + " | ".join(cells) + f" | {ratio} |")
        print()

"""What in MARS gives its gain against today's baselines: at the most loaded point of every set of
results/today/commands.sh, the fixed-strategy policies, shortest-predicted-first, and MARS without
its admission rule and starvation prevention, beside the baselines and the bound (MARS told the
future, results/today/bound/); mean and p99 over INFERCEPT's.

    python -m marsched.experiments.today_ablation run [SET...]   the runs: results/today/ablation/*.json
    python -m marsched.experiments.today_ablation               the table of every set whose runs are there
                                                                 (docs/ablation.md)

With no SET, `run` runs every set of results/today/commands.sh.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from marsched.experiments.today_frontier import ROOT, SETS, Compare, TodaySet, run_compares, sets_named

# (label, results file suffix, marsched compare flags); "" reads the set's own runs
RUNS = (
    ("preserve, discard, swap, sjf", "policies", ("--policies", "preserve,discard,swap,sjf")),
    ("mars, greedy admission", "greedy", ("--policies", "mars", "--admission", "greedy")),
    ("mars, greedy admission, no starvation prevention", "greedy-off",
     ("--policies", "mars", "--admission", "greedy", "--starvation", "off")),
)
BOUND = "bound: mars told the future"  # results/today/bound/: a bound, not a policy anyone can run
ROWS = ("vllm", "vllm-offload", "continuum", "autellix", "discard", "preserve", "swap", "infercept", "sjf",
        "mars, greedy admission, no starvation prevention", "mars, greedy admission", "mars", BOUND)


def run(sets: tuple[TodaySet, ...] = SETS) -> None:
    folder = ROOT / "ablation"
    folder.mkdir(parents=True, exist_ok=True)
    run_compares([Compare(f"{s.name} at {s.loads[-1]:g} qps: {label}", s, s.loads[-1:], flags,
                          folder / f"{s.name}-{suffix}.json") for s in sets for label, suffix, flags in RUNS])


def has_runs(s: TodaySet, today: Path = ROOT) -> bool:
    return all((today / "ablation" / f"{s.name}-{suffix}.json").exists() for _, suffix, _ in RUNS)


def records_at_top(today: Path = ROOT) -> dict[str, dict[str, dict]]:
    """Set name -> row label -> its record at the set's most loaded point, for the sets whose
    ablation runs are all there."""
    out: dict[str, dict[str, dict]] = {}
    for s in SETS:
        if not has_runs(s, today):
            continue
        top = s.loads[-1]
        rows = {r["policy"]: r for r in json.loads((today / f"{s.name}.json").read_text()) if r["qps"] == top}
        for label, suffix, _ in RUNS:
            for r in json.loads((today / "ablation" / f"{s.name}-{suffix}.json").read_text()):
                rows[r["policy"] if label.startswith("preserve") else label] = r
        bound = today / "bound" / f"{s.name}.json"
        if bound.exists():
            rows.update({BOUND: r for r in json.loads(bound.read_text()) if r["qps"] == top and r["policy"] == "mars"})
        out[s.name] = rows
    return out


def table(by_set: dict[str, dict[str, dict]]) -> str:
    """Mean / p99 end-to-end over INFERCEPT's, one row per policy or variant."""
    top = {s.name: s.loads[-1] for s in SETS}
    lines = ["| mean / p99 over INFERCEPT's | " + " | ".join(f"{n}, {top[n]:g} qps" for n in by_set) + " |",
             "| --- |" + " --- |" * len(by_set)]
    for label in ROWS:
        cells = []
        for rows in by_set.values():
            r, infercept = rows.get(label), rows["infercept"]
            cells.append("" if r is None else
                         f"{r['e2e_mean_s'] / infercept['e2e_mean_s']:.2f} / {r['e2e_p99_s'] / infercept['e2e_p99_s']:.2f}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if argv[:1] == ["run"]:
        try:
            chosen = sets_named(argv[1:])
        except ValueError as e:
            print(f"today_ablation: {e}", file=sys.stderr)
            return 2
        run(chosen or SETS)
        return 0
    if argv:
        print("usage: python -m marsched.experiments.today_ablation [run [SET...]]", file=sys.stderr)
        return 2
    by_set = records_at_top(ROOT)
    if not by_set:
        print(f"today_ablation: no runs in {ROOT / 'ablation'}: run "
              "`python -m marsched.experiments.today_ablation run` first", file=sys.stderr)
        return 1
    print(table(by_set))
    left_out = [s.name for s in SETS if s.name not in by_set]
    if left_out:
        print(f"\n(no ablation runs for {', '.join(left_out)})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

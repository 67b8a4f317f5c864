"""Print the README's tables from results/never-loses/*.json (written by scripts/never_loses.sh),
and draw the mean/p99 trade-off at each trace's most loaded point (results/never-loses/frontier.png).
With `calibrated` as the first argument, the same from results/never-loses-calibrated/ (written by
scripts/never_loses.sh calibrated). The seed sweep's table (`never_loses.sh SET --seeds`) comes
last when its results are there."""

from __future__ import annotations

import sys
from pathlib import Path

from marsched.experiments.never_loses_sets import RUN_SETS, TRACES
from marsched.experiments.never_loses_tables import print_tables, set_results

_ROOT = Path(__file__).resolve().parent.parent / "results"

if __name__ == "__main__":
    args = sys.argv[1:]
    results = set_results(args.pop(0) if args and args[0] in RUN_SETS else "gptj", _ROOT)
    traces = args or list(TRACES)
    unknown = [t for t in traces if t not in results.top]
    if unknown:
        sys.exit(f"usage: never_loses_tables.py [{'|'.join(RUN_SETS)}] [TRACE ...]; unknown: {', '.join(unknown)} "
                 f"(traces: {', '.join(results.top)})")
    print_tables(results, traces)

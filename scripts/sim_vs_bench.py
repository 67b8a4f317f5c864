"""The simulator against a `marsched bench` run: the same requests on a profile, side by side.

    .venv/bin/python scripts/sim_vs_bench.py BENCH.json --profile PROFILE.json [--json OUT]

For every record of the bench run, the simulator replays the stream that point replayed (the
trace, seed, rate, duration, token and API-time scales and context limit of the record) with
the record's policy, on the profile with its device KV blocks set to what the bench's engine
had. It prints the bench's and the simulator's mean end-to-end latency, the error, and
whether the two rank the policies in the same order at each rate.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from marsched.experiments.sim_vs_bench import comparison, comparison_lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bench_json")
    parser.add_argument("--profile", required=True, help="a profile name or .json path (e.g. from marsched calibrate)")
    parser.add_argument("--json", help="write the comparison here")
    args = parser.parse_args()
    try:
        records = json.loads(Path(args.bench_json).read_text())
        if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
            raise ValueError("expected a list of records")
    except (OSError, ValueError) as error:
        print(f"error: {args.bench_json}: not a marsched bench JSON ({error})", file=sys.stderr)
        return 2
    rows, orders = comparison(records, args.profile)
    print("\n".join(comparison_lines(rows, orders)))
    if args.json:
        Path(args.json).write_text(json.dumps({"bench": args.bench_json, "profile": args.profile, "rows": rows,
                                               "orders": {str(k): v for k, v in orders.items()}}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The simulator against INFERCEPT's published GPT-J curve (normalized latency over arrival rate).

What is compared, the published points and their source, the knee rule and the profile
variants: marsched.experiments.infercept_curve.

Usage (about 8 minutes on 2 cores; the bundled profile over three seeds, 3 minutes):
    .venv/bin/python scripts/infercept_curve.py [--duration 1800] [--workers 2]
    .venv/bin/python scripts/infercept_curve.py --variants bundled --seeds 0,1,2 --out results/infercept-curve-seeds
Writes OUT.json and OUT.png (default results/infercept-curve).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from marsched.experiments.infercept_curve import QPS, VARIANTS, run

ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=1800.0,
                        help="seconds of arrivals (INFERCEPT's window is 1,800 s)")
    parser.add_argument("--seeds", default="0",
                        help="comma-separated seeds: curves are the mean over them, knees given per seed too")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--qps", default=",".join(f"{q:g}" for q in QPS))
    parser.add_argument("--variants", default=",".join(name for name, _, _ in VARIANTS))
    parser.add_argument("--out", default=str(ROOT / "results" / "infercept-curve"))
    args = parser.parse_args(argv)
    try:
        seeds = [int(seed) for seed in args.seeds.split(",")]
        qps_values = [float(q) for q in args.qps.split(",")]
    except ValueError:
        parser.error(f"--seeds {args.seeds!r} / --qps {args.qps!r}: give comma-separated integers / numbers")
    if 1.0 not in qps_values:
        parser.error("--qps must include 1 (the knees are multiples of the latency at 1 req/s)")
    chosen = args.variants.split(",")
    unknown = set(chosen) - {name for name, _, _ in VARIANTS}
    if unknown:
        parser.error(f"--variants: unknown {', '.join(sorted(unknown))}; valid: {', '.join(n for n, _, _ in VARIANTS)}")
    run(args.duration, seeds, args.workers, args.qps, chosen, Path(args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

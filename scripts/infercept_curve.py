"""The simulator against INFERCEPT's published GPT-J curve (normalized latency over arrival rate).

INFERCEPT (ICML 2024) published, for GPT-J 6B on one A100 and its six-augmentation mix (our
bundled multi-API trace), the mean normalized latency of vLLM, Preserve and INFERCEPT over the
arrival rate: the InferCept post on the WukLab blog, results figure panel (a),
github.com/WukLab/wuklab_sysml@92e190d static/images/infercept/results.jpg. The points below
are read off that figure by eye (about ±5 ms/token below 100, ±15 above).

Normalized latency is INFERCEPT's: per request, (end − arrival − time inside API calls) over
the tokens it generated, API-returned tokens included (WukLab/InferCept@3a1a4da
benchmarks/final_tput_bench_real.py L411, where returns are appended as output tokens), averaged
over requests (`np.mean(latencies)`, L437). Our records compute the same
(`norm_latency_mean_s_per_token`); INFERCEPT's harness also counts requests unfinished at the end
of its 1,800 s window up to that end, which ours (which drains) does not.

The knee: the arrival rate at which the mean normalized latency first exceeds `factor` times its
value at 1 req/s, linearly interpolated between the measured rates; the published knees are
computed from the published points with the same rule, so the comparison is like for like.
We report factor 2 (the first clear rise) and factor 5 (the cliff).

Besides the bundled profile, the sweep runs variants that change one cost each, to show which
costs move the curve toward the published one; each override carries its source, and an
override fitted to the published curve says so.

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

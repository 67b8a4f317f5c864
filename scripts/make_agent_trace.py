"""Rewrite the bundled agent trace (the named trace ``agent``) from its generator, byte for byte.

    .venv/bin/python scripts/make_agent_trace.py            # both bundled copies
    .venv/bin/python scripts/make_agent_trace.py OUT.jsonl  # somewhere else (tests compare it)
"""

from __future__ import annotations

import sys
from pathlib import Path

from marsched.workload.agent import BUNDLED_COUNT, BUNDLED_SEED, agent_requests
from marsched.workload.jsonl import save_jsonl

REPO = Path(__file__).resolve().parents[1]
FILE = "agent_long_context.jsonl"
# The repository copy and the package-data copy must stay identical (a test checks it).
BUNDLED = (REPO / "data" / "workloads" / FILE, REPO / "src" / "marsched" / "workload" / "data" / FILE)


def main(argv: list[str]) -> None:
    requests = agent_requests(BUNDLED_COUNT, seed=BUNDLED_SEED)
    for path in [Path(a) for a in argv] or BUNDLED:
        print(save_jsonl(requests, path))


if __name__ == "__main__":
    main(sys.argv[1:])

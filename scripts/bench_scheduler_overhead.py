"""How much time MarsScheduler adds per engine step over vLLM's own scheduler, with many waiting requests.

The benchmark is `marsched.bench.overhead` (its docstring has the method); this is its command:

    flock /tmp/marsched-engine.lock .venv/bin/python scripts/bench_scheduler_overhead.py \
        [--sizes 100,1000,10000] [--connector on|off] [--repeats 3] [--json OUT]
"""

from __future__ import annotations

import sys

from marsched.bench.overhead import main

if __name__ == "__main__":
    sys.exit(main())

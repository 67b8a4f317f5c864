"""What the front end pays per request to find an unnamed conversation's rank (`marsched.serve.history`):
hashing a chat body's messages and looking them up among `--remembered` conversations, beside
`json.loads` of the same body (which every middleware does already).

    .venv/bin/python scripts/bench_history.py --requests 2000
"""

from __future__ import annotations

import argparse
import json
import time

from marsched.serve.history import history_of
from marsched.vllm.follow_ups import FollowUps

PATH = "/v1/chat/completions"


def percentiles(times: list[float]) -> str:
    times = sorted(times)
    return f"p50 {times[len(times) // 2] * 1e3:.3f} ms, p99 {times[int(0.99 * len(times))] * 1e3:.3f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--remembered", type=int, default=10_000)
    parser.add_argument("--messages", type=int, default=40, help="messages after the system prompt")
    parser.add_argument("--chars", type=int, default=700, help="characters per message")
    args = parser.parse_args()

    system = {"role": "system", "content": "s" * 4000}  # shared by every conversation
    follow = FollowUps(limit=args.remembered)
    for index in range(args.remembered):
        history = history_of(PATH, {"messages": [system, {"role": "user", "content": f"{index} " + "u" * args.chars}]})
        follow.finished(f"c{index}", history.size, len(history.hashes), history.hashes, 0.0, history.tail)
    messages = [system] + [{"role": "user" if i % 2 else "assistant", "content": f"{i} " + "m" * args.chars}
                           for i in range(args.messages)]
    raw = json.dumps({"messages": messages})
    body = json.loads(raw)
    hashing, parsing = [], []
    for _ in range(args.requests):
        start = time.perf_counter()
        history = history_of(PATH, body)
        follow.match(history.hashes, history.size, history.prompt)
        hashing.append(time.perf_counter() - start)
        start = time.perf_counter()
        json.loads(raw)
        parsing.append(time.perf_counter() - start)
    print(f"{len(messages)} messages, {len(raw):,} bytes, {args.remembered:,} conversations remembered")
    print(f"history + match: {percentiles(hashing)}")
    print(f"json.loads:      {percentiles(parsing)}")


if __name__ == "__main__":
    main()

"""Micro-benchmark: what recognising follow-ups (`marsched.vllm.follow_ups`) adds per request.

The block hashes are vLLM's to compute either way (`Request.block_hashes`); what the scheduler adds
per request is one `match` at arrival and one `finished` at the end (and `expire`, amortised O(1)).
With RETAINED conversations remembered, each request is timed as either a follow-up (its previous
turn's prompt and reply, plus a tool result of TOOL_TOKENS) or a new request that continues none
(every block looked up: the worst case).

    .venv/bin/python scripts/bench_follow_ups.py [--retained 10000] [--prompt-tokens 4096] [--block 16]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import time

from marsched.vllm.follow_ups import FollowUps


def chain(parent: bytes, count: int) -> list[bytes]:
    out = []
    for _ in range(count):
        parent = hashlib.sha256(parent + os.urandom(8)).digest()
        out.append(parent)
    return out


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--retained", type=int, default=10_000)
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    parser.add_argument("--reply-tokens", type=int, default=256)
    parser.add_argument("--tool-tokens", type=int, default=512)
    parser.add_argument("--block", type=int, default=16)
    parser.add_argument("--requests", type=int, default=20_000)
    args = parser.parse_args()
    block = args.block
    system = chain(b"system", 1024 // block)  # every conversation shares a 1024-token system prompt
    follow = FollowUps()
    turns = []
    for index in range(args.retained):
        prompt = system + chain(index.to_bytes(8, "big"), (args.prompt_tokens - 1024) // block)
        whole = prompt + chain(prompt[-1], args.reply_tokens // block)
        follow.finished(f"c{index}", len(prompt) * block, len(prompt), whole, 0.0)
        turns.append(whole)
    follow_up_s, new_s, finished_s = [], [], []
    for request in range(args.requests):
        index = request % args.retained
        whole = turns[index]
        tokens = whole + chain(whole[-1], args.tool_tokens // block)
        stranger = system + chain(b"new" + request.to_bytes(8, "big"), len(tokens) - len(system))
        start = time.perf_counter()
        found = follow.match(tokens, len(tokens) * block)
        follow_up_s.append(time.perf_counter() - start)
        assert found == f"c{index}"
        start = time.perf_counter()
        assert follow.match(stranger, len(stranger) * block) is None
        new_s.append(time.perf_counter() - start)
        reply = tokens + chain(tokens[-1], args.reply_tokens // block)
        start = time.perf_counter()
        follow.finished(found, len(tokens) * block, len(tokens), reply, 0.0)
        follow.expire(1.0)
        finished_s.append(time.perf_counter() - start)
        turns[index] = reply[:len(whole)] if len(reply) > 4 * len(whole) else reply
    print(f"{args.retained} retained conversations, prompts of {args.prompt_tokens}+ tokens "
          f"({len(turns[0])}+ blocks of {block}), a tool result of {args.tool_tokens} tokens:")
    for name, values in (("follow-up match", follow_up_s), ("new-request match (no hit)", new_s),
                         ("finished + expire", finished_s)):
        print(f"  {name:28s} p50 {statistics.median(values) * 1e3:.4f} ms  p99 {percentile(values, 0.99) * 1e3:.4f} ms  "
              f"max {max(values) * 1e3:.4f} ms")
    total = [a + b for a, b in zip(follow_up_s, finished_s)]
    print(f"  per follow-up request (match + finished) p99 {percentile(total, 0.99) * 1e3:.4f} ms")
    total = [a + b for a, b in zip(new_s, finished_s)]
    print(f"  per new request (match + finished) p99 {percentile(total, 0.99) * 1e3:.4f} ms")


if __name__ == "__main__":
    main()

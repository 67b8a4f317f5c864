"""The HTTP comparison's command line (docs/bench.md, "HTTP comparison"):

    python -m marsched.experiments.http_bench --model DIR --configs vllm-stock,vllm,infercept,continuum,mars \
        --rate 0.1 --duration 60 --repeats 3 --out results/http/light

For each repeat, for each configuration (interleaved, `order`): start its server on the same model,
KV size, engine options and cores, replay the same `marsched loadgen` workload, stop the server.
Progress on stderr, the Markdown summary on stdout, every file under --out.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from marsched.experiments.http_bench.configs import (
    CONFIGS, DEFAULT_ENGINE, ORACLE, Engine, check_configs, check_out_folder, pin_seconds,
)
from marsched.experiments.http_bench.run import Plan, progress, run_plan
from marsched.loadgen.options import CLAUDE_CODE, SESSION_CHOICES, WORKLOADS, LoadgenOptions, load_sessions

# The default workload: agent-text turns bounded so that a conversation fits the tiny model's 4,096
# tokens (8 turns of 400 characters: a last context of 2,300 of its tokens, median, at most 2,800) while
# the 40 KV blocks (5,120 tokens) hold only two to four conversations at once: memory binds.
TURN_CHARS = 400
MAX_TURNS = 8
MAX_GAP_S = 3.0


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m marsched.experiments.http_bench",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", required=True, help="model directory or name (e.g. built by `marsched model`)")
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help=f"comma-separated, of {', '.join(CONFIGS)} (the default), and {ORACLE} (a diagnostic)")
    p.add_argument("--out", required=True, help="folder for the runs' files and the summary")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rate", type=float, default=0.1, help="conversations arriving per second")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals")
    p.add_argument("--seed", type=int, default=0, help="of the arrivals (loadgen) and of the servers")
    p.add_argument("--workload", default="agent-text", choices=WORKLOADS)
    p.add_argument("--turn-chars", type=int, default=None,
                   help=f"agent-text: cut each turn's new text and reply to N characters (default {TURN_CHARS}; "
                        "0: whole turns)")
    p.add_argument("--reply-chars", type=int, default=None,
                   help="agent-text: cut each reply to N characters instead of --turn-chars (0: whole replies)")
    p.add_argument("--sessions", default="all", choices=SESSION_CHOICES,
                   help="agent-text: held-out replays only the sessions the packaged agent head never trained on")
    p.add_argument("--max-turns", type=int, default=MAX_TURNS, help="per conversation; 0: all")
    p.add_argument("--gap-scale", type=float, default=1.0)
    p.add_argument("--max-gap-s", type=float, default=MAX_GAP_S, help="cap of every tool gap; <0: none")
    p.add_argument("--token-scale", type=float, default=1.0, help="claude-code only")
    p.add_argument("--max-tokens", type=int, default=4096, help="every turn's max_tokens (a fixed cap)")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds before a turn counts as failed")
    p.add_argument("--kv-blocks", type=int, default=DEFAULT_ENGINE.kv_blocks, help="--num-gpu-blocks-override")
    p.add_argument("--max-model-len", type=int, default=DEFAULT_ENGINE.max_model_len)
    p.add_argument("--fixed-s", type=float, default=None,
                   help="T of continuum's --retention fixed:T (default: 2 x the median gap as replayed)")
    p.add_argument("--vllm-arg", action="append", default=[], help="one more vLLM option for every server (repeat)")
    p.add_argument("--marsched-arg", action="append", default=[],
                   help="one more `marsched serve` option for the marsched configurations (repeat)")
    p.add_argument("--start-timeout", type=float, default=900.0, help="seconds for a server to become healthy")
    p.add_argument("--resume", action="store_true",
                   help="keep the runs an earlier comparison measured in --out with the same settings; run the rest")
    return p.parse_args(argv)


def plan_of(args: argparse.Namespace) -> Plan:
    """The plan the arguments describe; ValueError naming the first bad flag."""
    configs = check_configs([c.strip() for c in args.configs.split(",") if c.strip()])
    turn_chars = args.turn_chars if args.turn_chars is not None else (0 if args.workload == CLAUDE_CODE
                                                                         else TURN_CHARS)
    load = LoadgenOptions("http://127.0.0.1:1", args.workload, None, args.rate, args.duration, args.seed,
                          args.gap_scale, args.max_gap_s if args.max_gap_s >= 0 else None, args.token_scale,
                          args.max_turns, args.max_tokens, True, args.request_timeout, turn_chars, args.sessions,
                          reply_chars=args.reply_chars)
    load.check()
    if args.repeats < 1:
        raise ValueError(f"--repeats {args.repeats}: give a number >= 1")
    if args.fixed_s is not None and not args.fixed_s > 0:
        raise ValueError(f"--fixed-s {args.fixed_s:g}: give a number of seconds > 0")
    fixed_s = args.fixed_s
    if fixed_s is None:
        fixed_s = pin_seconds(load_sessions(load), load.gap_scale, load.max_gap_s) if "continuum" in configs else 0.0
    check_out_folder(args.out)
    engine = Engine(args.model, args.kv_blocks, args.max_model_len, args.seed, tuple(args.vllm_arg),
                    tuple(args.marsched_arg))
    return Plan(tuple(configs), args.repeats, engine, load, fixed_s, Path(args.out), args.start_timeout, args.resume)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        plan = plan_of(args)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    progress(f"{len(plan.configs)} configurations x {plan.repeats} repeats; {plan.load.workload} at "
             f"{plan.load.rate:g} conversations/s for {plan.load.duration_s:g} s, {plan.engine.kv_blocks} KV blocks"
             + (f"; continuum pins for {plan.fixed_s:g} s" if "continuum" in plan.configs else ""))
    return run_plan(plan)


if __name__ == "__main__":
    sys.exit(main())

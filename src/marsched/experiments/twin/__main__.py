"""The live twin's command line (docs/twin.md):

    python -m marsched.experiments.twin --model DIR --profile PROFILE.json --out results/twin/run

Claude Code sessions, scaled to the model (`--token-scale`, `--gap-scale`, `--max-gap-s`,
`--max-turns`), replayed task by task through the simulator and against live servers, one per
configuration, at a light load and a queueing one (picked by the simulator over `--grid`, or given
with `--loads`); simulated and live side by side, per configuration, with their ratio.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from marsched.bench.engine_config import BLOCK_TOKENS
from marsched.experiments.http_bench.configs import CONFIGS, Engine, check_configs, check_out_folder, pin_seconds
from marsched.experiments.twin.configs import SIM_POLICY
from marsched.experiments.twin.loads import parse_loads
from marsched.experiments.twin.run import TwinPlan, progress, run_twin
from marsched.experiments.twin.simulate import SimEngine
from marsched.loadgen.options import CLAUDE_CODE, LoadgenOptions, load_sessions

# The shaping: contexts up to 27k tokens (the bundled sessions' largest is 895k) on a 32k model;
# tool gaps a tenth of the recorded ones, at most 10 s (the median becomes 0.8 s); 20 calls a task
# at most (the 99th percentile is 69).
TOKEN_SCALE = 0.03
GAP_SCALE = 0.1
MAX_GAP_S = 10.0
MAX_TURNS = 20
KV_BLOCKS = 257  # 32,768 tokens and vLLM's null block: the longest context fits alone, about nine median ones together
MAX_MODEL_LEN = 32768
MAX_NUM_SEQS = 64
MAX_NUM_BATCHED_TOKENS = 4096
GRID = "0.2,0.4,0.6,0.8,1,1.2,1.5,2,2.5,3,4,5,6,8,10"  # up to where a fast machine queues too (docs/twin.md)
# The live servers predict as their twins do: from the replies served (filler text has nothing a
# learned head could read; `marsched serve`'s own default reads the text).
LIVE_PREDICTOR = "online"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m marsched.experiments.twin", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", required=True, help="model directory (`marsched model --max-position 32768`)")
    p.add_argument("--profile", required=True, help="the engine's profile (`marsched calibrate --out`)")
    p.add_argument("--out", required=True, help="folder for the records, the table and the live runs' files")
    p.add_argument("--configs", default=",".join(c for c in CONFIGS if c in SIM_POLICY),
                   help=f"comma-separated, of {', '.join(SIM_POLICY)}")
    p.add_argument("--loads", default="auto",
                   help="NAME:RATE pairs in tasks/s (light:0.05,queueing:0.5), or auto: picked by the simulator")
    p.add_argument("--grid", default=GRID, help="with --loads auto: the rates the simulator sweeps")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--token-scale", type=float, default=TOKEN_SCALE)
    p.add_argument("--gap-scale", type=float, default=GAP_SCALE)
    p.add_argument("--max-gap-s", type=float, default=MAX_GAP_S)
    p.add_argument("--max-turns", type=int, default=MAX_TURNS, help="model calls per task at most; 0: all")
    p.add_argument("--kv-blocks", type=int, default=KV_BLOCKS, help="--num-gpu-blocks-override (128-token blocks)")
    p.add_argument("--max-model-len", type=int, default=MAX_MODEL_LEN)
    p.add_argument("--max-num-seqs", type=int, default=MAX_NUM_SEQS)
    p.add_argument("--max-num-batched-tokens", type=int, default=MAX_NUM_BATCHED_TOKENS)
    p.add_argument("--pin-s", type=float, default=None,
                   help="continuum's T (default: 2 x the median gap as replayed, as http_bench picks it)")
    p.add_argument("--marsched-arg", action="append", default=[],
                   help="one more `marsched serve` option for the marsched configurations (repeat)")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--sim-only", action="store_true", help="simulate only; no server is started")
    p.add_argument("--resume", action="store_true",
                   help="keep the live runs an earlier twin measured in --out with the same settings; run the rest")
    return p.parse_args(argv)


def plan_of(args: argparse.Namespace) -> TwinPlan:
    """The plan the arguments describe; ValueError naming the first bad flag."""
    configs = check_configs([c.strip() for c in args.configs.split(",") if c.strip()])
    missing = [c for c in configs if c not in SIM_POLICY]
    if missing:
        raise ValueError(f"--configs: {', '.join(missing)} has no simulated twin; give some of {', '.join(SIM_POLICY)}")
    loads = None if args.loads == "auto" else parse_loads(args.loads)
    try:
        grid = tuple(float(r) for r in args.grid.split(",") if r.strip())
    except ValueError:
        raise ValueError(f"--grid {args.grid!r}: give comma-separated rates in tasks/s") from None
    if loads is None and (not grid or any(not r > 0 for r in grid)):
        raise ValueError(f"--grid {args.grid!r}: give rates > 0")
    if args.repeats < 1:
        raise ValueError(f"--repeats {args.repeats}: give a number >= 1")
    for flag, value in (("--kv-blocks", args.kv_blocks), ("--max-model-len", args.max_model_len),
                        ("--max-num-seqs", args.max_num_seqs), ("--max-num-batched-tokens", args.max_num_batched_tokens)):
        if value < 1:
            raise ValueError(f"{flag} {value}: give a number >= 1")
    if (args.kv_blocks - 1) * BLOCK_TOKENS < args.max_model_len:  # vLLM's null block holds nothing
        raise ValueError(f"--kv-blocks {args.kv_blocks}: vLLM refuses a cache that cannot hold one "
                         f"--max-model-len {args.max_model_len} context; give at least "
                         f"{-(-args.max_model_len // BLOCK_TOKENS) + 1}")
    if not Path(args.profile).is_file():
        raise ValueError(f"--profile {args.profile}: no such file (make it with `marsched calibrate --out`)")
    check_out_folder(args.out)  # now, not after the simulations
    load = LoadgenOptions("http://127.0.0.1:1", CLAUDE_CODE, None, 1.0, args.duration, args.seed, args.gap_scale,
                          args.max_gap_s if args.max_gap_s >= 0 else None, args.token_scale, args.max_turns,
                          request_timeout_s=args.request_timeout)
    load.check()
    pin_s = args.pin_s
    if pin_s is None:
        pin_s = pin_seconds(load_sessions(load), load.gap_scale, load.max_gap_s)
    elif not pin_s > 0:
        raise ValueError(f"--pin-s {pin_s:g}: give a number of seconds > 0")
    batch = ("--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens))
    marsched_args = ("--predictor", LIVE_PREDICTOR, *args.marsched_arg)  # a later --predictor wins
    engine = Engine(args.model, args.kv_blocks, args.max_model_len, args.seed, batch, marsched_args)
    sim_engine = SimEngine(args.profile, args.kv_blocks, args.max_num_seqs, args.max_num_batched_tokens)
    return TwinPlan(tuple(configs), loads, grid, args.repeats, engine, sim_engine, load, pin_s, Path(args.out),
                    args.sim_only, resume=args.resume)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        plan = plan_of(args)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    progress(f"{len(plan.configs)} configurations; claude-code x {plan.load.token_scale:g} tokens, gaps x "
             f"{plan.load.gap_scale:g}; {plan.engine.kv_blocks} KV blocks"
             + ("; simulated only" if plan.sim_only else f"; {plan.repeats} live repeats"))
    return run_twin(plan)


if __name__ == "__main__":
    sys.exit(main())

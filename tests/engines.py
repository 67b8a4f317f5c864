"""AugmentedEngines (AsyncLLM, MarsScheduler, the Swap connector; CPU, tiny model) shared by the
tests, one per configuration, each on an event loop of its own (started and stopped by
`shared.SharedPool`).

- `runtime_engine`: MARS; test_vllm_runtime.py sends every strategy through it by
  per-request overrides, then audits its whole trace;
- `audit_vllm_engine`, `audit_infercept_engine`, `audit_discard_engine`: one per strategy rule
  vLLM runs differently (test_vllm_audit.py);
- `learned_engine`: MARS with lengths predicted by the learned model (test_vllm_learned.py).

Each writes its event trace to `trace_file` in its own folder. A test on a shared engine
uses request ids of its own and checks only those requests, or state it waits to be idle.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loop_thread import LoopThread

START_TIMEOUT_S = 300
# Several engines are alive at once: a KV cache of this many 32-token blocks (64 MiB of the tiny
# model's KV, 1 KiB a token) instead of the 1 GiB that VLLM_CPU_KVCACHE_SPACE fills; far more than
# any test here holds at once, so memory never binds.
KV_BLOCKS = 2048


@dataclass(frozen=True)
class EngineConfig:
    name: str  # the session fixture that hands it out (conftest.py)
    policy: str
    max_model_len: int = 512
    mars: dict[str, Any] = field(default_factory=dict)  # more of MarsConfig

    def __call__(self, model: str, folder: Path) -> "SharedEngine":
        return SharedEngine(self, model, folder / "events.jsonl")


class SharedEngine:
    """An AugmentedEngine starting on a loop of its own; `engine` once `wait_ready()` returns."""

    def __init__(self, config: EngineConfig, model: str, trace_file: Path) -> None:
        self.config, self.trace_file = config, trace_file
        self.loop = LoopThread()
        self.engine: Any = None

        async def start():
            from marsched.vllm import AugmentedEngine

            engine = AugmentedEngine(model, policy=config.policy, trace_path=str(trace_file), mars=config.mars,
                                     dtype="float32", enforce_eager=True, block_size=32,
                                     max_model_len=config.max_model_len, num_gpu_blocks_override=KV_BLOCKS, seed=0,
                                     # Several engines live in this process, started side by side:
                                     # vLLM's Prometheus loggers would register the same series twice.
                                     disable_log_stats=True)
            engine.trace_file = trace_file
            self.engine = engine  # before start(): close() stops what a failed start left
            return await engine.start()

        self._started = self.loop.submit(start())

    def wait_ready(self) -> None:
        self._started.result(START_TIMEOUT_S)

    def run(self, coro, timeout: float = 120.0):
        return self.loop.run(coro, timeout)

    def shutdown(self) -> None:
        """Stop the engine (its core writes the trace's `end` event on the way out); idempotent."""
        engine, self.engine = self.engine, None
        if engine is not None:
            async def stop():
                engine.shutdown()

            self.loop.run(stop(), timeout=60)

    def close(self) -> None:
        try:
            if not self._started.done():
                self._started.result(START_TIMEOUT_S)  # a start cannot be interrupted
        except BaseException:  # noqa: BLE001 - reported by the tests that wait for it
            pass
        try:
            self.shutdown()
        finally:
            self.loop.close()


RUNTIME = EngineConfig("runtime_engine", "mars", max_model_len=2048)
AUDIT_POLICIES = ("vllm", "infercept", "discard")
AUDITED = {policy: EngineConfig(f"audit_{policy}_engine", policy) for policy in AUDIT_POLICIES}
LEARNED = EngineConfig("learned_engine", "mars", max_model_len=2048, mars={"predictor": "learned"})
SHARED = {config.name: config for config in (RUNTIME, *AUDITED.values(), LEARNED)}

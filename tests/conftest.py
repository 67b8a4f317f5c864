"""Fixtures for the vLLM tests: the tiny model, built once per session, and an event loop thread."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest

# Before vLLM is imported: 1 GiB of CPU KV cache; the in-process LLM keeps its engine
# core in this process (AsyncLLM always starts its own engine-core process).
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    pytest.importorskip("vllm")
    from tiny_model import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("tiny") / "model"))


class LoopThread:
    """An asyncio loop in a thread, so that an AsyncLLM outlives one test."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro, timeout: float = 120.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


@pytest.fixture(scope="module")
def loop_thread():
    runner = LoopThread()
    yield runner
    runner.close()

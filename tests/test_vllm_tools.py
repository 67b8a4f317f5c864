"""Tools of the augmented runtime (no vLLM needed): the safe calculator, the registry's faults."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from marsched.vllm.tools import ToolError, ToolRegistry, default_tools, safe_eval
from marsched.workload.model import ApiType


def test_calculator_is_arithmetic_only():
    assert safe_eval("2 + 3 * (4 - 1) ** 2") == 29
    assert asyncio.run(default_tools().call("calculator", "6*7")) == "42"
    for bad in ["__import__('os')", "a + 1", "(1).real", "2 ** 10000", "[1, 2]"]:
        with pytest.raises(ValueError):
            safe_eval(bad)


def test_registry_turns_every_failure_into_a_tool_error():
    registry = ToolRegistry()

    @registry.tool("slow", api_type="qa", expected_duration_s=0.1, timeout_s=0.05)
    async def slow(args):
        await asyncio.sleep(1)

    async def boom(args):
        raise KeyError("x")

    registry.register("boom", boom, ApiType.MATH)
    with pytest.raises(ToolError, match="timed out after 0.05 s"):
        asyncio.run(registry.call("slow", None))
    with pytest.raises(ToolError, match="raised KeyError"):
        asyncio.run(registry.call("boom", None))
    with pytest.raises(ToolError, match="unknown tool"):
        asyncio.run(registry.call("nope", None))
    with pytest.raises(TypeError):
        registry.register("sync", lambda args: 1)
    assert registry.get("slow").api_type is ApiType.QA


def test_sleep_tool_replays_an_api():
    assert asyncio.run(default_tools().call("sleep", {"duration_s": 0.01, "tokens": [1, 2]})) == [1, 2]


def test_http_get_rejects_non_http_urls():
    with pytest.raises(ToolError, match="only http"):
        asyncio.run(default_tools().call("http_get", "file:///etc/passwd"))


def test_marsched_imports_without_vllm():
    code = ("import sys; sys.modules['vllm'] = None\n"
            "import marsched, marsched.vllm, marsched.vllm.config, marsched.vllm.tools, marsched.vllm.metadata\n"
            "try:\n    marsched.vllm.MarsScheduler\nexcept ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "pip install 'marsched[vllm]'" in out

"""Sync server tools run in threads of their own: calls of one that hang cannot starve another."""

import asyncio
import json
import sys
import time

import pytest

from marsched.serve.tool_config import ToolsConfigError, load_tools_config
from marsched.vllm.tools import ToolError

_MODULE = '''
import time

def hang(args):
    time.sleep(3)
    return "late"

def quick(args):
    return "quick"
'''


@pytest.fixture
def tools(tmp_path, monkeypatch):
    (tmp_path / "threads_fixture.py").write_text(_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "threads_fixture", raising=False)
    path = tmp_path / "tools.json"
    path.write_text(json.dumps({"tools": [
        {"name": "hang", "function": "threads_fixture:hang", "timeout_s": 0.3, "threads": 2},
        {"name": "quick", "function": "threads_fixture:quick", "timeout_s": 1.0}]}))
    return load_tools_config(path).registry


def test_hung_calls_of_one_tool_leave_another_tool_its_threads(tools):
    async def scenario():
        # More hung calls than the event loop's default pool has threads (min(32, cores + 4)).
        hung = await asyncio.gather(*(tools.call("hang", {}) for _ in range(40)), return_exceptions=True)
        started = time.monotonic()
        answer = await tools.call("quick", {})
        return hung, answer, time.monotonic() - started

    hung, answer, seconds = asyncio.run(scenario())
    assert all(isinstance(h, ToolError) and "timed out" in str(h) for h in hung)
    assert answer == "quick" and seconds < 1.0


@pytest.mark.parametrize("entry, problem", [
    ({"name": "t", "function": "threads_fixture:quick", "threads": 0}, "threads must be an integer from 1 to 256"),
    ({"name": "t", "function": "threads_fixture:quick", "threads": 2.5}, "threads must be an integer"),
    ({"name": "t", "builtin": "calculator", "threads": 2}, "threads is for a function tool"),
])
def test_a_bad_threads_value_is_named(tmp_path, monkeypatch, entry, problem):
    (tmp_path / "threads_fixture.py").write_text(_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    path = tmp_path / "tools.json"
    path.write_text(json.dumps({"tools": [entry]}))
    with pytest.raises(ToolsConfigError, match=problem):
        load_tools_config(path)

"""The audit's request stream for a real engine, and reading a trace once its engine has ended.

`mixed_requests` is what each audited engine serves (test_vllm_audit.py per policy,
test_vllm_runtime.py on its MARS engine): four augmented requests (two calls each) and two
plain ones at once, with ids under a tag, so that they can share an engine with other tests.
"""

from __future__ import annotations

import asyncio
import time

from marsched.audit import audit_trace
from marsched.metrics.trace import read_trace
from marsched.vllm import Step, ToolCall
from test_trace_schema import schema_errors

REQUESTS = 6


def steps(index: int) -> list[Step]:
    call = ToolCall("sleep", {"duration_s": 0.05 + 0.05 * index, "tokens": [100 + index] * 4})
    return [Step(12 + index, call), Step(8, call), Step(6)]


async def mixed_requests(engine, tag: str) -> list:
    """The engine's results for the stream, in order: `{tag}-aug-0..3`, then `{tag}-plain-0..1`."""
    augmented = [engine.generate(list(range(10 + i, 40 + i)), steps(i), request_id=f"{tag}-aug-{i}",
                                 ignore_eos=True) for i in range(4)]
    plain = [engine.generate(list(range(50 + i, 70 + i)), [Step(10)], request_id=f"{tag}-plain-{i}",
                             ignore_eos=True) for i in range(2)]
    return await asyncio.gather(*augmented, *plain)


def ended_trace(path, timeout_s: float = 60.0) -> list[dict]:
    """The trace once the engine-core process has shut down its scheduler (it writes `end` then;
    `shutdown()` returns before the process is done)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            events = read_trace(path)
        except ValueError:  # a line being written
            events = [{"event": None}]
        if events[-1]["event"] == "end" or time.monotonic() > deadline:
            return events
        time.sleep(0.2)


def assert_audited(trace, policy: str, requests: int) -> None:
    """The ended trace at `trace` follows the schema and passes the audit as `policy`."""
    events = ended_trace(trace)
    assert events[0]["event"] == "run" and events[0]["engine"] == "vllm" and events[-1]["event"] == "end"
    assert schema_errors(events) == []
    result = audit_trace(trace, policy)
    assert result.requests == requests
    assert result.violations == [], "\n".join(map(str, result.violations))

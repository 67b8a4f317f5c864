"""Each engine step's measured duration, for the cost model the scheduler learns (`policy.learned_cost`).

A step runs from the start of `schedule()` to the end of `update_from_output()` for the same
scheduler output: scheduling, the forward pass and sampling, output processing, and the Swap
connector's copies inside the step. That is the span `marsched calibrate` times
(`bench/steps.py`), so the two fits compare term by term. Idle time, when the engine waits for
requests, falls between one step's update and the next `schedule()` and is not counted.

With asynchronous scheduling (vLLM on GPUs) the engine schedules step N+1 while step N runs,
so a step starts at its `schedule()` or at the end of the previous step's update, whichever is
later: the span is then the time between two steps' ends while the engine is busy, its
throughput per step, and overlapping spans are not counted twice.

This module does not import vLLM.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from marsched.policy.cost_model import attention_pairs
from marsched.policy.learned_cost import StepShape


def step_shape(output: Any, requests: dict[str, Any]) -> StepShape | None:
    """The cost model's regressors for the step `schedule()` just returned (`output`, a vLLM
    `SchedulerOutput`), read from the scheduler's `requests`; None for a step that computes nothing.
    vLLM has already advanced each scheduled request's computed tokens by what it scheduled (cached
    plus new), so a request's context is its computed tokens and its new ones attend to what came
    before them."""
    tokens = output.total_num_scheduled_tokens
    if not tokens:
        return None
    scheduled = output.num_scheduled_tokens
    computed = {rid: requests[rid].num_computed_tokens for rid in scheduled if rid in requests}
    pairs = sum(attention_pairs(scheduled[rid], done - scheduled[rid]) for rid, done in computed.items())
    return StepShape(tokens, sum(computed.values()), len(scheduled), pairs)


# Stock vLLM's scheduler with this clock beside it (`step_meter.py`, which imports vLLM), and the
# environment variable naming the file it writes its step costs to.
METERED_SCHEDULER = "marsched.vllm.step_meter.MeteredScheduler"
METER_ENV = "MARSCHED_STEP_METER"

_OPEN_MAX = 8  # steps scheduled and not yet updated (vLLM keeps at most its batch queue's, 1 or 2)


class StepClock:
    def __init__(self) -> None:
        self._open: deque[tuple[Any, float, StepShape]] = deque(maxlen=_OPEN_MAX)
        self._last_end = float("-inf")

    def scheduled(self, output: Any, start: float, shape: StepShape) -> None:
        """`schedule()` began at `start` and returned `output`, a step of `shape`."""
        self._open.append((output, start, shape))

    def updated(self, output: Any, end: float) -> tuple[StepShape, float] | None:
        """`update_from_output(output)` ended at `end`: the step's shape and seconds, or None for a
        step not seen scheduled (one that computed nothing)."""
        for index, (candidate, start, shape) in enumerate(self._open):
            if candidate is output:
                del self._open[index]
                begin = max(start, self._last_end)
                self._last_end = end
                return (shape, end - begin) if end > begin else None
        self._last_end = max(self._last_end, end)
        return None

"""Per-step timing inside vLLM's engine core: schedulers that log every step to a file.

`marsched bench` loads `StepTimedMarsScheduler` (MarsScheduler + this timer) as vLLM's
`scheduler_cls`; `StepTimedScheduler` is vLLM's own scheduler with the same timer (for
comparisons with stock vLLM). The engine core runs in its own process, so the log goes
through a file named by the environment variable `MARSCHED_STEP_LOG` (read when the
scheduler is built; without it nothing is recorded).

One JSON line per step (CPU execution is synchronous: schedule, forward, update):

- `t`: `time.monotonic()` at the start of `schedule()` (the clock of the event trace);
- `sched_s`: time inside `schedule()` (the scheduler's own cost, policy included);
- `update_s`: time inside `update_from_output()` (the scheduler's bookkeeping of the outputs);
- `step_s`: start of `schedule()` to the end of `update_from_output()` (scheduling, the
  forward pass and sampling, output processing: vLLM's iteration time);
- `tokens`: tokens scheduled (new prefill tokens plus one per decoding sequence);
- `seqs`: sequences scheduled; `prefill_seqs`: those scheduled more than one token;
- `ctx`: context tokens of the scheduled sequences after the step (what attention reads);
- `pairs`: attention pairs of the step (`policy.cost_model.attention_pairs` of each sequence's
  scheduled tokens on its cached ones), what prefill attention computes (`ctx` and `pairs` as
  `vllm.step_clock.step_shape` reads them, the regressors of the server's learned cost model).

Steps that schedule nothing are logged with `tokens: 0`. Lines are buffered and flushed at
least every `FLUSH_S` seconds and at shutdown, so a killed engine loses at most that much.

This module imports vLLM; load it only in an engine (by its dotted name).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler

from marsched.vllm.scheduler import MarsScheduler
from marsched.vllm.step_clock import step_shape

ENV_VAR = "MARSCHED_STEP_LOG"
FLUSH_S = 0.5
STEP_TIMED_MARS = "marsched.bench.steps.StepTimedMarsScheduler"
STEP_TIMED_VLLM = "marsched.bench.steps.StepTimedScheduler"


class StepTimerMixin:
    """Times `schedule()` and the whole step; mix in before a vLLM scheduler class."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        path = os.environ.get(ENV_VAR)
        self._step_file = open(path, "a", encoding="utf-8") if path else None  # noqa: SIM115 - closed at shutdown
        self._step_lines: list[str] = []
        self._step_flushed_t = time.monotonic()
        self._step_open: tuple[float, float] | None = None  # (start of schedule, time inside it)

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        start = time.monotonic()
        output = super().schedule(*args, **kwargs)
        self._step_open = (start, time.monotonic() - start)
        return output

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        # Context before the update: `schedule()` already counted this step's tokens as computed, and
        # the update drops the requests that finish (their context would be missing from the last step).
        counts = scheduler_output.num_scheduled_tokens
        shape = step_shape(scheduler_output, self.requests) if self._step_file is not None else None
        ctx, pairs = (shape.context_tokens, shape.attention_pairs) if shape is not None else (0, 0)
        begin = time.monotonic()
        result = super().update_from_output(scheduler_output, model_runner_output)
        if self._step_file is not None and self._step_open is not None:
            start, sched_s = self._step_open
            self._step_open = None
            end = time.monotonic()
            self._step_lines.append(json.dumps({
                "t": round(start, 6), "sched_s": round(sched_s, 7), "update_s": round(end - begin, 7),
                "step_s": round(end - start, 7),
                "tokens": scheduler_output.total_num_scheduled_tokens, "seqs": len(counts),
                "prefill_seqs": sum(1 for n in counts.values() if n > 1), "ctx": ctx, "pairs": pairs,
            }, separators=(",", ":")))
            if end - self._step_flushed_t >= FLUSH_S:
                self._flush_steps(end)
        return result

    def _flush_steps(self, now: float) -> None:
        if self._step_file is not None and self._step_lines:
            self._step_file.write("\n".join(self._step_lines) + "\n")
            self._step_file.flush()
            self._step_lines.clear()
        self._step_flushed_t = now

    def shutdown(self) -> None:
        try:
            super().shutdown()
        finally:
            if self._step_file is not None:
                self._flush_steps(time.monotonic())
                self._step_file.close()
                self._step_file = None


class StepTimedMarsScheduler(StepTimerMixin, MarsScheduler):
    """`MarsScheduler` that logs each step (see the module docstring)."""


class StepTimedScheduler(StepTimerMixin, Scheduler):
    """vLLM's own scheduler that logs each step."""


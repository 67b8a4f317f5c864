"""Stock vLLM's scheduler with a step meter: the step costs of a server that marsched does not schedule.

The twin simulates each live configuration at the step costs its own server measured
(`experiments/twin/served_costs.py`). A marsched server learns them as it schedules and shows them
in `/marsched/state`; stock vLLM learns nothing, and its steps are not `--policy vllm`'s (the
plugin's bookkeeping and its server's middlewares share the cores). So the benchmarks start stock
vLLM with

    MARSCHED_STEP_METER=FILE --scheduler-cls marsched.vllm.step_meter.MeteredScheduler

vLLM's own `Scheduler`, every decision its own, with the plugin's step clock and fit beside it
(`StepClock`, `LearnedCost` from the same placeholder constants), so the terms compare with a
marsched server's term by term. The fit is written to FILE as JSON (`LearnedCost.snapshot`, the
whole run's fit under `run`) at most once a second while the engine steps, and when its last
request is done, replacing the file whole. The meter costs the engine about 15 µs a step (the
fits, timed offline): 1% of the shortest step on the twin's machine (1.25 ms, a decode step of one
sequence), far less of the chunked prefills that dominate a queueing load.

A fault of the meter (a file it cannot write) is logged once and ends the metering, never the
engine.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from vllm.logger import init_logger
from vllm.v1.core.sched.scheduler import Scheduler

from marsched.atomic import write_atomically
from marsched.policy.learned_cost import CostSource, LearnedCost
from marsched.vllm.config import MarsConfig
from marsched.vllm.step_clock import METER_ENV, StepClock, step_shape

logger = init_logger(__name__)

WRITE_EVERY_S = 1.0


def meter_path(environ: Mapping[str, str]) -> Path:
    """The file the meter writes, from `METER_ENV`; ValueError when it is unset or empty."""
    value = environ.get(METER_ENV, "").strip()
    if not value:
        raise ValueError(f"marsched.vllm.step_meter.MeteredScheduler: set {METER_ENV} to the JSON file "
                         "the measured step costs go to")
    return Path(value)


class MeteredScheduler(Scheduler):
    """vLLM's `Scheduler`, unchanged, timing its steps into a learned cost model."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._meter_file: Path | None = meter_path(os.environ)
        super().__init__(*args, **kwargs)
        start = MarsConfig().cost_model(self.max_num_scheduled_tokens)  # a marsched server's placeholders
        self._meter = LearnedCost(start, CostSource.PLACEHOLDER, CostSource.PLACEHOLDER)
        self._meter_clock = StepClock()
        self._meter_written_t = -float("inf")

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        began = time.monotonic()
        output = super().schedule(*args, **kwargs)
        if self._meter_file is not None:  # else the metering has ended (a fault)
            shape = step_shape(output, self.requests)
            if shape is not None:
                self._meter_clock.scheduled(output, began, shape)
        return output

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        result = super().update_from_output(scheduler_output, model_runner_output)
        if self._meter_file is not None:
            self._measure(scheduler_output)
        return result

    def _measure(self, scheduler_output: Any) -> None:
        try:
            now = time.monotonic()
            measured = self._meter_clock.updated(scheduler_output, now)
            if measured is not None:
                self._meter.observe_step(*measured)
            # Also when the last request is done: an engine that goes idle writes its last steps.
            if now - self._meter_written_t >= WRITE_EVERY_S or not self.has_unfinished_requests():
                self._meter_written_t = now
                text = json.dumps(self._meter.snapshot(), allow_nan=False) + "\n"
                write_atomically(self._meter_file, lambda f: f.write(text.encode()))
        except Exception:  # noqa: BLE001 - metering ends; the engine goes on
            logger.exception("marsched: the step meter failed; %s is no longer written", self._meter_file)
            self._meter_file = None

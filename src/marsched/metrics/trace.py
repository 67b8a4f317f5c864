"""The event trace: one JSON object per line, written atomically.

Every event has `event`, `t` (seconds of engine time) and, for request events, `rid`.
Events and their extra fields:

| event | fields |
| --- | --- |
| arrive | prompt_tokens, segments |
| predict | segment, output_tokens, api_s, return_tokens, predictor, source (front-end: the vLLM front end's learned prediction; plan: the request's plan). Written by the vLLM scheduler at each segment's start |
| assign_strategy | segment, strategy, reason (ahead, at-call, reconsidered, fixed, host-full), context_tokens, api_s |
| admit | segment, prefill_tokens, wait_s (the request leaves the queue and gets device blocks) |
| schedule | iteration, iterations (>1 when identical decode iterations are run together), batch, tokens, dt_s, free_blocks, host_free_blocks |
| preempt | segment, strategy, freed_blocks |
| api_start | segment, strategy (null for a trailing call, whose KV is freed at the call), context_tokens (at the call), duration_s |
| swap_out | blocks (transfer finished; device blocks freed) |
| swap_in | blocks (transfer finished; host blocks freed) |
| api_end | segment, return_tokens |
| resume | segment, where (device, waiting, host) |
| promote | counter (the starvation threshold was reached) |
| finish | e2e_s, ttft_s |
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from marsched.atomic import AtomicFile


class EventTrace:
    """Collects events; `TraceFile` writes them. The base class drops them (no trace asked for)."""

    enabled = False

    def emit(self, event: str, t: float, rid: str | None = None, **fields: Any) -> None:
        pass

    def close(self) -> None:
        pass

    def abort(self) -> None:
        pass


class TraceFile(EventTrace):
    """Writes to a temporary file beside `path` and renames it at `close`, so that a run that
    fails leaves no partial trace behind (`marsched.atomic.AtomicFile`: a symlink is written
    through; a special file such as /dev/stdout or /dev/null is written directly)."""

    enabled = True

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._out = AtomicFile(self.path)

    def emit(self, event: str, t: float, rid: str | None = None, **fields: Any) -> None:
        record = {"event": event, "t": round(t, 6)}
        if rid is not None:
            record["rid"] = rid
        record.update(fields)
        self._out.file.write((json.dumps(record, separators=(",", ":")) + "\n").encode())

    def close(self) -> None:
        self._out.commit()

    def abort(self) -> None:
        self._out.discard()


def read_trace(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    with open(path) as file:
        return [json.loads(line) for line in file if line.strip()]

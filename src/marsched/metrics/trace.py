"""The event trace: one JSON object per line, written atomically.

Every event has `event`, `t` (seconds of engine time) and, for request events, `rid`.
Events and their extra fields:

| event | fields |
| --- | --- |
| arrive | prompt_tokens, segments |
| assign_strategy | segment, strategy, reason (ahead, at-call, reconsidered, fixed, host-full), context_tokens, api_s |
| admit | segment, prefill_tokens, wait_s (the request leaves the queue and gets device blocks) |
| schedule | iteration, iterations (>1 when identical decode iterations are run together), batch, tokens, dt_s, free_blocks, host_free_blocks |
| preempt | segment, strategy, freed_blocks |
| api_start | segment, strategy, context_tokens, duration_s |
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
import tempfile
from pathlib import Path
from typing import IO, Any


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
    fails leaves no partial trace behind."""

    enabled = True

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, self._tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", dir=self.path.parent)
        self._file: IO[str] = os.fdopen(fd, "w")

    def emit(self, event: str, t: float, rid: str | None = None, **fields: Any) -> None:
        record = {"event": event, "t": round(t, 6)}
        if rid is not None:
            record["rid"] = rid
        record.update(fields)
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")

    def close(self) -> None:
        self._file.close()
        os.replace(self._tmp, self.path)

    def abort(self) -> None:
        self._file.close()
        Path(self._tmp).unlink(missing_ok=True)


def read_trace(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    with open(path) as file:
        return [json.loads(line) for line in file if line.strip()]

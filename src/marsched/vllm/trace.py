"""The scheduler's event trace: `marsched.metrics.trace` records, written line by line.

`TraceFile` renames its file into place only at `close`; the engine-core process
may be killed rather than closed, and tests read the trace while the engine runs,
so this writer appends and flushes each event instead. Lines have the same form
(`event`, `t`, `rid`, fields) and are read by `marsched.metrics.trace.read_trace`.
Times are `time.monotonic()` seconds, shared by all processes of one host.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from marsched.metrics.trace import EventTrace

logger = logging.getLogger(__name__)


class LiveTrace(EventTrace):
    enabled = True

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", buffering=1)

    def emit(self, event: str, t: float, rid: str | None = None, **fields: Any) -> None:
        if not self.enabled:
            return
        record: dict[str, Any] = {"event": event, "t": round(t, 6)}
        if rid is not None:
            record["rid"] = rid
        record.update(fields)
        try:
            self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
        except (OSError, ValueError) as error:  # a full disk must not stop the engine: stop tracing
            logger.error("marsched: writing the event trace failed (%s); tracing stops here", error)
            self.enabled = False
            try:
                self._file.close()
            except OSError:
                pass

    def close(self) -> None:
        if not self._file.closed:
            try:
                self._file.close()
            except OSError:  # the last line could not be flushed (a full disk)
                pass

    abort = close


def open_trace(path: str | None, data_parallel_rank: int = 0) -> EventTrace:
    """The trace at `path`, or rank r's own file beside it under data parallelism (`rank_path`)."""
    return LiveTrace(rank_path(path, data_parallel_rank)) if path else EventTrace()


def rank_path(path: str, data_parallel_rank: int) -> str:
    """Rank 0 writes `path`; rank r > 0 `<stem>.rank<r><suffix>` beside it (`trace.jsonl`:
    `trace.rank1.jsonl`): each engine core has a trace of its own, which the audit checks alone."""
    if data_parallel_rank == 0:
        return path
    given = Path(path)
    return str(given.with_name(f"{given.stem}.rank{data_parallel_rank}{given.suffix}"))

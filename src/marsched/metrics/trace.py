"""The event trace: one JSON object per line, written atomically.

The schema is `trace.schema.json` beside this module (version `SCHEMA_VERSION`), and
`docs/trace-format.md` explains it: the one place for what each event carries. Both
engines write it; `marsched audit` reads it, from them or from any other engine.

Every event has `event`, `t` (seconds of engine time), `iteration` (the engine's
scheduling iteration), and the KV blocks in use engine-wide after it
(`kv_device_blocks`, `kv_host_blocks`); a request's events add `rid`, `segment` and
`queue` (where the request is after the event, `Queue`). The first line is a `run`
event declaring the engine, the policy (its order, strategy rule and starvation rule)
and the capacities; the last is an `end` event.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from enum import Enum

from marsched.atomic import AtomicFile

SCHEMA_VERSION = 1
SCHEMA_PATH = Path(__file__).with_name("trace.schema.json")


class Queue(str, Enum):
    """Where a request is after an event (the `queue` field: docs/trace-format.md, "Event trace")."""

    WAITING = "waiting"  # in the waiting queue; needs prefill (new, preempted or discarded)
    RUNNING = "running"  # KV on the device, in the batch (or being swapped in)
    PAUSED = "paused"  # inside an API call (KV preserved, discarded, or being swapped out)
    SWAPPED = "swapped"  # call returned, KV in host memory, in the waiting queue for a swap-in
    FINISHED = "finished"


# The queue a request is in after each event; `resume` depends on where its KV is, and
# `assign_strategy` changes no queue (the engine writes the request's current one).
QUEUE_AFTER: dict[str, Queue] = {
    "arrive": Queue.WAITING,
    "admit": Queue.RUNNING,
    "preempt": Queue.WAITING,
    "promote": Queue.WAITING,
    "api_start": Queue.PAUSED,
    "swap_out": Queue.PAUSED,
    "api_end": Queue.PAUSED,
    "swap_in": Queue.RUNNING,
    "finish": Queue.FINISHED,
}
RESUME_QUEUE: dict[str, Queue] = {"device": Queue.RUNNING, "waiting": Queue.WAITING, "host": Queue.SWAPPED}


def event_fields(event: str, iteration: int, segment: int | None, fields: dict[str, Any],
                 kv_device_blocks: int, kv_host_blocks: int) -> dict[str, Any]:
    """The fields every event carries (`trace.schema.json`) around the event's own: a request's
    events (`segment` given) add where the request is after the event, unless the event says."""
    common: dict[str, Any] = {"iteration": iteration}
    if segment is not None:
        common["segment"] = segment
        queue = QUEUE_AFTER.get(event) or RESUME_QUEUE.get(fields.get("where"))
        if queue is not None:
            common["queue"] = queue.value
    common.update(fields)
    common["kv_device_blocks"] = kv_device_blocks
    common["kv_host_blocks"] = kv_host_blocks
    return common


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

"""`marsched export --perfetto`: a trace in the Chrome Trace Event format, which Perfetto's UI
(ui.perfetto.dev) and `chrome://tracing` open.

One process holds a track (thread) per request, in arrival order, with a slice per state
(queued, running, in a call by strategy, swapping); another holds the engine's counters:
queue lengths and KV blocks in use on the device and the host. Times are microseconds from
the start of the run, so a run of hours zooms like any other trace.
"""

from __future__ import annotations

import json
import os
from typing import Any

from marsched.atomic import write_atomically
from marsched.audit.timeline import QUEUES, Timeline

REQUESTS_PID, ENGINE_PID = 1, 2


def chrome_trace(timeline: Timeline) -> dict[str, Any]:
    def us(t: float) -> float:
        return round((t - timeline.start) * 1e6, 3)

    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": REQUESTS_PID, "tid": 0, "args": {"name": "requests"}},
        {"ph": "M", "name": "process_sort_index", "pid": REQUESTS_PID, "tid": 0, "args": {"sort_index": 1}},
        {"ph": "M", "name": "process_name", "pid": ENGINE_PID, "tid": 0,
         "args": {"name": f"engine ({timeline.engine}, {timeline.policy})"}},
        {"ph": "M", "name": "process_sort_index", "pid": ENGINE_PID, "tid": 0, "args": {"sort_index": 0}},
    ]
    tid = {rid: index + 1 for index, rid in enumerate(timeline.requests)}
    for rid, thread in tid.items():
        events.append({"ph": "M", "name": "thread_name", "pid": REQUESTS_PID, "tid": thread, "args": {"name": rid}})
        events.append({"ph": "M", "name": "thread_sort_index", "pid": REQUESTS_PID, "tid": thread,
                       "args": {"sort_index": thread}})
    for span in timeline.spans:
        if span.rid not in tid:  # events of a request whose arrival is not in the trace
            tid[span.rid] = len(tid) + 1
            events.append({"ph": "M", "name": "thread_name", "pid": REQUESTS_PID, "tid": tid[span.rid],
                           "args": {"name": span.rid}})
        events.append({"ph": "X", "name": span.state.value, "cat": "request", "pid": REQUESTS_PID,
                       "tid": tid[span.rid], "ts": us(span.start), "dur": round((span.end - span.start) * 1e6, 3),
                       "args": {"request": span.rid, "segment": span.segment}})
    last_queues: tuple[int, ...] | None = None
    last_kv: tuple[int, int] | None = None
    for i, t in enumerate(timeline.times):
        queues = tuple(timeline.queues[q][i] for q in QUEUES)
        if queues != last_queues:
            events.append({"ph": "C", "name": "queue length", "pid": ENGINE_PID, "tid": 0, "ts": us(t),
                           "args": dict(zip(QUEUES, queues))})
            last_queues = queues
        kv = (timeline.kv_device[i], timeline.kv_host[i])
        if kv != last_kv:
            events.append({"ph": "C", "name": "KV blocks in use", "pid": ENGINE_PID, "tid": 0, "ts": us(t),
                           "args": {"device": kv[0], "host": kv[1]}})
            last_kv = kv
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"engine": timeline.engine, "policy": timeline.policy, "device_blocks": timeline.device_blocks,
                      "host_blocks": timeline.host_blocks, "requests": len(timeline.requests)},
    }


def write_chrome_trace(timeline: Timeline, path: str | os.PathLike[str]) -> None:
    document = chrome_trace(timeline)
    write_atomically(path, lambda f: f.write(json.dumps(document, separators=(",", ":")).encode()))

"""A soak: the conversation load for long, with the server's memory sampled, then what is left.

`scripts/conversation_bench.py --soak` adds, per configuration:

- `rss`: the resident memory of the server's whole process tree (API server, engine cores,
  workers), sampled every `RSS_EVERY_S` during the load: at its start, its peak and its end,
  and the growth from start to end;
- `after_idle`: after the load, `idle_s` later (past marsched's retention limit, so that every
  conversation the clients left is due to be freed), whether the server still answers
  `/health`, whether its process is alive, and what it still holds: for marsched, every rank's
  kept conversations, host bytes, paused and tracked requests and used device blocks; for stock
  vLLM, its `vllm:kv_cache_usage_perc` (prefix-cache blocks still count as free there).
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import psutil

from marsched.experiments.conversations.servers import get

RSS_EVERY_S = 5.0
MIB = 1 << 20
# What a marsched server may still hold after the idle wait, summed over its ranks (`after_idle`):
# its scheduler's counters, then the host bytes and the device blocks in use.
SCHEDULER_HELD = ("retained_preserve", "retained_swap", "retained_device_blocks", "retained_host_tokens", "paused",
                  "tracked", "running", "waiting")
HELD = (*SCHEDULER_HELD, "host_bytes", "device_blocks_used")


class RssSampler:
    """The RSS of a process and its descendants, sampled in a thread until `stop`."""

    def __init__(self, pid: int, every_s: float = RSS_EVERY_S) -> None:
        self.pid, self.every_s = pid, every_s
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._began = time.monotonic()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            self.samples.append((time.monotonic() - self._began, tree_rss(self.pid)))
            if self._stop.wait(self.every_s):
                return

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join()
        values = [rss for _, rss in self.samples if rss]
        if not values:
            return {"samples": []}
        return {"start_mib": values[0] / MIB, "peak_mib": max(values) / MIB, "end_mib": values[-1] / MIB,
                "growth_mib": (values[-1] - values[0]) / MIB,
                "samples": [(round(t, 1), round(rss / MIB, 1)) for t, rss in self.samples]}


def tree_rss(pid: int) -> int:
    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for process in processes:
        try:
            total += process.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def after_idle(url: str, process: Any, idle_s: float) -> dict[str, Any]:
    time.sleep(idle_s)
    left: dict[str, Any] = {"idle_s": idle_s, "alive": process.poll() is None,
                            "health": get(f"{url}/health") is not None}
    state = get(f"{url}/marsched/state")
    if state is not None:
        answer = json.loads(state)
        ranks = answer.get("ranks") or [answer]
        for key in SCHEDULER_HELD:
            left[key] = sum(int((rank.get("scheduler") or {}).get(key) or 0) for rank in ranks)
        left["host_bytes"] = sum(int(rank.get("host_bytes") or 0) for rank in ranks)
        left["device_blocks_used"] = sum(int((rank.get("scheduler") or {}).get("device_total_blocks") or 0)
                                         - int((rank.get("scheduler") or {}).get("device_free_blocks") or 0)
                                         for rank in ranks)
    metrics = get(f"{url}/metrics")
    if metrics is not None:
        from prometheus_client.parser import text_string_to_metric_families

        usage = [s.value for family in text_string_to_metric_families(metrics.decode()) for s in family.samples
                 if s.name == "vllm:kv_cache_usage_perc"]
        left["kv_cache_usage"] = max(usage) if usage else None
    return left

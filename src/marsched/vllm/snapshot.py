"""What the scheduler shows of itself: `/marsched/state`, the `marsched_*` metrics, tests.

`mars_snapshot` is read in-process (`MarsWorkerExtension`, one worker) or published with the
Swap connector's metadata (vLLM on CPU runs the worker in its own process). Publishing happens
only when a request's state changed since the last publication or `PUBLISH_EVERY_S` passed, and
the snapshot's cost is in the requests inside a call, not in all tracked ones.
"""

from __future__ import annotations

import time
from typing import Any

from marsched.policy import Strategy
from marsched.vllm.kv_swap import SwapMeta

PUBLISH_EVERY_S = 0.5  # the engine-wide counters (blocks, queue lengths) go stale at most this long
MEMORY_TIME_SHARE = 0.01  # the most of the scheduler's time the memory × time gauge may take


class Inspection:
    """Mixed into `MarsSchedulerMixin`: `_tracked`, `_done`, `_in_call`, `_changed` are set up there."""

    def _info(self, tracked: Any) -> dict[str, Any]:
        segments = []
        for index in range(tracked.progress.segment_index + 1):
            prediction = tracked.predictions.get(index)
            assignments = [a for a in tracked.progress.assignments if a.segment_index == index]
            last = assignments[-1] if assignments else None
            segments.append({
                "index": index,
                "predicted_output_tokens": prediction.output_tokens if prediction else None,
                "predicted_api_s": prediction.api_duration_s if prediction else None,
                "predicted_return_tokens": prediction.api_return_tokens if prediction else None,
                # where its length came from: the front end's number, or the plan's (`max_tokens`)
                "prediction_source": "front-end" if index in tracked.front_end_predictions else "plan",
                "strategy": tracked.strategies[index] if index < len(tracked.strategies) else
                (last.strategy.value if last else None),
                "assigned_s": assignments[0].assigned_s if assignments else None,
                "reason": last.reason if last else None,
                "assignments": [(a.strategy.value, a.assigned_s, a.reason) for a in assignments],
            })
        return {"request_id": tracked.rid, "segments": segments, "preemptions": tracked.preemptions,
                "arrival_t": tracked.arrival_t, "first_token_t": tracked.first_token_t, "kv": tracked.kv,
                "retention": tracked.retention.to_dict() if tracked.retention is not None else None,
                "finished": False}

    def mars_snapshot(self, request_id: str | None = None) -> dict[str, Any]:
        pool = self.kv_cache_manager.block_pool
        state: dict[str, Any] = {
            "iteration": self._iteration,
            "device_total_blocks": pool.num_gpu_blocks - 1,  # the null block is never free
            "device_free_blocks": pool.get_num_free_blocks(),
            "device_usage": self.kv_cache_manager.usage,
            "host_tokens": self._swapper.host_tokens_used if self._swapper else 0,
            "running": len(self.running),
            "waiting": len(self.waiting),
            "paused": self.num_waiting_for_streaming_input,
            "tracked": len(self._tracked),
            "policy": self.mars_policy.name,
            "retention": self._retention.name,
            "promotions": self.lifecycle.promotions,
            "cost_model": self.mars_cost.snapshot(),
            "memory_time_in_flight": self._memory_time_in_flight(),
            **self._paused_by_strategy(),
            **self._keeper.snapshot(),
            "tool_gap_global_s": self._gaps.global_s,
            "tool_gaps": self._gaps.snapshot(),
            **self._programs.snapshot(),
            **(self._follow_ups.snapshot() if self._follow_ups is not None else {}),
            **self._told.snapshot(),
        }
        if request_id is not None:
            found = self._done.get(request_id)
            if found is None:
                internal = self._internal_id(request_id)
                tracked = self._tracked.get(internal)
                found = self._info(tracked) if tracked else None
                if tracked is not None:
                    found["blocks"] = sum(len(i) for i in self.kv_cache_manager.get_block_ids(internal))
            state["request"] = found
        return state

    def _memory_time_in_flight(self) -> float:
        """The predicted KV memory × time (token-seconds) that the tracked requests will still
        hold: the MARS ranking key (`Policy.memory_time`) summed, a load signal for a router.
        It is O(tracked): recomputed when the engine becomes empty or stops being empty, else at
        most every PUBLISH_EVERY_S, or MEMORY_TIME_SHARE's inverse times its own cost if longer."""
        now = time.monotonic()
        count = len(self._tracked)
        next_t, computed_count, value = self._memory_time
        if now < next_t and (count == 0) == (computed_count == 0):
            return value
        load = self._load()
        value = 0.0
        for tracked in self._tracked.values():
            if tracked.progress.predictions:  # predicted at its arrival; not yet if it just came
                value += self.mars_policy.memory_time(tracked.progress, load)
        took_s = time.monotonic() - now
        self._memory_time = (now + max(PUBLISH_EVERY_S, took_s / MEMORY_TIME_SHARE), count, value)
        return value

    def _paused_by_strategy(self) -> dict[str, int]:
        counts = {f"paused_{s.value}": 0 for s in Strategy}
        for tracked in self._in_call.values():
            if tracked.strategies:
                counts[f"paused_{tracked.strategies[-1]}"] += 1
        return counts

    def _internal_id(self, rid: str) -> str:
        if rid in self._tracked:
            return rid
        for internal, tracked in self._tracked.items():
            if tracked.rid == rid:
                return internal
        return rid

    def _mark_changed(self, tracked: Any) -> None:
        """A request's event: its info is published with the next step (`_publish`)."""
        self._changed.add(tracked.progress.request_id if tracked.rid not in self._done else tracked.rid)
        if self._swapper is not None:
            self._swapper.snapshot_dirty = True

    def _publish(self, meta: Any) -> None:
        """Put the state on this step's connector metadata, when it changed or went stale."""
        if not isinstance(meta, SwapMeta):
            return
        now = time.monotonic()
        if not (self._changed or self._swapper.snapshot_dirty or now - self._published_t >= PUBLISH_EVERY_S):
            return
        self._swapper.snapshot_dirty = False
        self._published_t = now
        changed, self._changed = self._changed, set()
        requests = {}
        for rid in changed:
            tracked = self._tracked.get(rid)
            info = self._info(tracked) if tracked else self._done.get(rid)
            if info is not None:
                requests[info["request_id"]] = info
        meta.snapshot = {"state": self.mars_snapshot(), "requests": requests}

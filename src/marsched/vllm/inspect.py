"""Reading the engine's state from the client: a worker extension, loaded by configuration.

`worker_extension_cls="marsched.vllm.inspect.MarsWorkerExtension"` adds
`mars_state` to vLLM's worker; `AsyncLLM.collective_rpc("mars_state", args=(rid,))`
calls it between engine steps. It reports the worker's host-swap copies (the
memory the Swap connector really holds) and, when the scheduler lives in the same
process (one worker: vLLM's `UniProcExecutor`, the case on CPU and single GPU),
the scheduler's block pool and per-request decisions. Otherwise (on CPU vLLM always
runs the worker in its own process) the scheduler publishes the same state with
each step's Swap-connector metadata, and keeps the engine stepping once after a
change so that the published state is current; this needs the Swap connector.
"""

from __future__ import annotations

from typing import Any


class MarsWorkerExtension:
    def mars_state(self, request_id: str | None = None) -> dict[str, Any]:
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        from marsched.vllm.kv_swap import HostSwapConnector
        from marsched.vllm.scheduler import live_schedulers

        state: dict[str, Any] = {"host_bytes": 0, "host_requests": []}
        connector = get_kv_transfer_group() if has_kv_transfer_group() else None
        if isinstance(connector, HostSwapConnector):
            state["host_bytes"] = connector.host_bytes
            state["host_requests"] = sorted(connector.host)
            state["swap_stats"] = dict(connector.stats)
        schedulers = live_schedulers()
        if schedulers:  # the scheduler is in this process
            state["scheduler"] = schedulers[-1].mars_snapshot(request_id)
        elif isinstance(connector, HostSwapConnector) and connector.scheduler_state:
            # Published by the scheduler with each step's connector metadata.
            state["scheduler"] = dict(connector.scheduler_state)
            if request_id is not None:
                state["scheduler"]["request"] = connector.request_info.get(request_id)
        return state

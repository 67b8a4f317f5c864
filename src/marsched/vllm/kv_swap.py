"""Swap: a KV connector that copies a paused request's KV blocks to host memory and back.

Loaded by configuration (no vLLM file is touched):

    KVTransferConfig(kv_connector="HostSwapConnector", kv_role="kv_both",
                     kv_connector_module_path="marsched.vllm.kv_swap",
                     kv_connector_extra_config={"swap_blocks_per_step": 64})  # optional budget

vLLM builds it twice: role SCHEDULER in the EngineCore (`scheduler.connector`,
driven by `MarsScheduler`) and role WORKER beside the model (it gets the KV tensors
in `register_kv_caches` and does the copies in `start_load_kv`). This module is the
glue; the copies are `kv_copy.KvMover`'s, the per-step budget `kv_copy_plan.OutPlanner`'s,
the block layout `kv_copy_layout.resolve_layout`'s (docs/swap.md).

Protocol (see docs/vllm-internals.md, "Swap"):
1. call starts: `queue_swap_out(rid, block_ids, tokens)`; the request keeps its blocks.
2. next steps: the metadata carries the swap-out in chunks of the step budget
   (`swap_blocks_per_step` / `swap_bytes_per_step` in `kv_connector_extra_config`; none:
   the whole copy in one step); the worker copies them to host. `SwapMeta.swap_out` names
   a copy in the step that carries its last chunk, and only then.
3. `update_from_output` of that step: the scheduler frees the device blocks (on CUDA the
   next step's compute waits on the device for the copy to land).
4. call returns: `expect_load[rid] = tokens`; the request re-enters `waiting` with
   `num_computed_tokens = 0`.
5. admission: `get_num_new_matched_tokens` reports the saved tokens as a synchronous
   external hit; `update_state_after_alloc` records the new blocks as the target.
6. that step: the worker copies host -> device before the forward.
A finished or aborted request's host copy is dropped (`request_finished`), and the
connector keeps the engine stepping until the drop has reached the worker.

vLLM's own `OffloadingConnector` is not used: on CPU it refuses to start, and on
GPUs it is a prefix-cache store (it offloads blocks by hash and loads them on a
prefix hit), not a "move this paused request out now and back later" primitive.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from marsched.vllm.kv_copy import KvMover
from marsched.vllm.kv_copy_plan import Cancelled, OutChunk, OutPlanner, blocks_per_step, check_budget
from marsched.vllm.kv_host import bytes_per_block, extra_config, mover_for

BUDGET_BLOCKS_KEY = "swap_blocks_per_step"
BUDGET_BYTES_KEY = "swap_bytes_per_step"


def step_budget(vllm_config: Any, kv_cache_config: Any) -> int | None:
    """The swap-out budget in blocks per step from `kv_connector_extra_config` (None: no limit)."""
    extra = extra_config(vllm_config)
    blocks = check_budget(extra.get(BUDGET_BLOCKS_KEY), f"kv_connector_extra_config.{BUDGET_BLOCKS_KEY}")
    bytes_ = check_budget(extra.get(BUDGET_BYTES_KEY), f"kv_connector_extra_config.{BUDGET_BYTES_KEY}")
    return blocks_per_step(blocks, bytes_, bytes_per_block(kv_cache_config) if bytes_ is not None else 0)


_COPY_KEYS = ("out_blocks", "in_blocks", "out_s", "in_s")


@dataclass
class SwapCopyStats(KVConnectorStats):
    """The copies that landed since the worker last reported (`KvMover.stats`' keys): how they reach
    the scheduler, which learns the host link's rate from them (`policy.learned_cost`), through
    vLLM's own channel for connector stats (each step's `kv_connector_output`, summed over workers)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> "SwapCopyStats":
        return SwapCopyStats({k: self.data.get(k, 0) + other.data.get(k, 0) for k in _COPY_KEYS})

    def reduce(self) -> dict[str, int | float]:
        return {k: self.data.get(k, 0) for k in _COPY_KEYS}

    def is_empty(self) -> bool:
        return not (self.data.get("out_blocks") or self.data.get("in_blocks"))

    @property
    def blocks(self) -> int:
        return int(self.data.get("out_blocks", 0) + self.data.get("in_blocks", 0))

    @property
    def seconds(self) -> float:
        return float(self.data.get("out_s", 0.0) + self.data.get("in_s", 0.0))


@dataclass
class SwapMeta(KVConnectorMetadata):
    # Copies out whose last chunk is in this step (request id or host key, all its block ids):
    # the scheduler frees their blocks with this step's output.
    swap_out: list[tuple[str, list[int]]] = field(default_factory=list)
    # (request id, destination block ids, index of the first saved block to restore, host key of the copy)
    swap_in: list[tuple[str, list[int], int, str]] = field(default_factory=list)
    drop: list[str] = field(default_factory=list)
    # The scheduler's state after this step's schedule, for MarsWorkerExtension (the worker
    # may live in another process than the scheduler: on CPU vLLM always uses the mp executor).
    snapshot: dict[str, Any] | None = None
    # What the worker copies out this step (the step budget's share of each queued copy).
    out_chunks: list[OutChunk] = field(default_factory=list)


class HostSwapConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.block_size = vllm_config.cache_config.block_size
        self.num_blocks = getattr(kv_cache_config, "num_blocks", None)
        # scheduler side
        budget = step_budget(vllm_config, kv_cache_config) if role == KVConnectorRole.SCHEDULER else None
        self._planner = OutPlanner(budget)
        self._out_ids: dict[str, list[int]] = {}  # key -> all block ids of a copy being sent
        self._pending_in: dict[str, tuple[list[int], int, str]] = {}
        self._pending_drop: list[str] = []
        self.expect_load: dict[str, int] = {}  # rid -> tokens to restore
        self.load_from: dict[str, str] = {}  # rid -> host key of the copy it loads, when not its own
        self.host_tokens: dict[str, int] = {}  # rid -> tokens held on host (scheduler's account)
        self.last_swap_in: dict[str, int] = {}  # rid -> blocks restored, for the scheduler's trace
        self.snapshot_dirty = False  # the scheduler's state changed: run a step to publish it
        # worker side
        self.kv_caches: dict[str, torch.Tensor] = {}
        self.mover: KvMover | None = None
        self.scheduler_state: dict[str, Any] = {}
        self.request_info: dict[str, dict[str, Any]] = {}
        self._reported = dict.fromkeys(_COPY_KEYS, 0)  # copy stats already sent to the scheduler

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> SwapCopyStats:
        return SwapCopyStats(dict(data or {}))

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # we never hand KV to another engine

    # ---------------- scheduler side ----------------

    @property
    def blocks_per_step(self) -> int | None:
        return self._planner.blocks_per_step

    def queue_swap_out(self, req_id: str, block_ids: list[int], tokens: int) -> None:
        if req_id in self._planner and self._planner.cancel(req_id) is Cancelled.PARTIAL:
            self._pending_drop.append(req_id)  # the new copy starts over; the worker's part goes
        self._planner.queue(req_id, block_ids)
        self._out_ids[req_id] = list(block_ids)
        self.host_tokens[req_id] = tokens

    def cancel_swap_out(self, req_id: str) -> bool:
        """Stop a copy out that the scheduler has not been told is sent (its blocks stay)."""
        cancelled = self._planner.cancel(req_id)
        if cancelled is Cancelled.NOTHING:
            return False
        self._out_ids.pop(req_id, None)
        self.host_tokens.pop(req_id, None)
        if cancelled is Cancelled.PARTIAL:
            self._pending_drop.append(req_id)  # chunks already on the worker
        return True

    def drop(self, req_id: str) -> None:
        """Forget a request's host copy (its device blocks are kept or gone)."""
        self.expect_load.pop(req_id, None)
        self.load_from.pop(req_id, None)
        self._planner.cancel(req_id)
        self._out_ids.pop(req_id, None)
        self._pending_in.pop(req_id, None)
        if self.host_tokens.pop(req_id, None) is not None:
            self._pending_drop.append(req_id)

    @property
    def host_tokens_used(self) -> int:
        return sum(self.host_tokens.values())

    def has_pending_push_work(self) -> bool:
        # Keeps EngineCore stepping while only paused requests remain, so that a
        # queued swap-out (or a host-copy drop) reaches the worker.
        return bool(self._planner or self._pending_drop or self.snapshot_dirty)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        saved = self.expect_load.get(request.request_id, 0)
        return max(saved - num_computed_tokens, 0), False  # a synchronous load

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        rid = request.request_id
        saved = self.expect_load.pop(rid, None)
        source = self.load_from.pop(rid, rid)
        if saved is None:
            return
        if num_external_tokens <= 0:  # a local prefix hit covered it all
            self.drop(source)
            return
        first = (saved - num_external_tokens) // self.block_size  # the local hit is block-aligned
        last = -(-saved // self.block_size)
        ids = blocks.get_block_ids()[0][first:last]
        self._pending_in[rid] = (ids, first, source)
        self.host_tokens.pop(source, None)
        self.last_swap_in[rid] = len(ids)

    def build_connector_meta(self, scheduler_output: Any) -> SwapMeta:
        chunks = self._planner.take_step()
        meta = SwapMeta(
            swap_out=[(c.key, self._out_ids.pop(c.key)) for c in chunks if c.last],
            swap_in=[(rid, ids, first, source) for rid, (ids, first, source) in self._pending_in.items()],
            drop=list(self._pending_drop),
            out_chunks=chunks,
        )
        self._pending_in.clear()
        self._pending_drop.clear()
        return meta

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self.drop(rid)  # its host copy, if any, is dropped on the worker at the next step
        return False, None

    # ---------------- worker side ----------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.kv_caches = kv_caches
        self.mover = mover_for(self._vllm_config, kv_caches, self.num_blocks)  # None: nothing to swap

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, SwapMeta)
        if meta.snapshot is not None:
            self.scheduler_state = meta.snapshot["state"]
            self.request_info.update(meta.snapshot["requests"])
            while len(self.request_info) > 10_000:
                self.request_info.pop(next(iter(self.request_info)))
        if self.mover is None:
            if meta.out_chunks or meta.swap_in:
                raise RuntimeError("HostSwapConnector: a copy was asked for before the KV caches were registered")
            return
        for rid in meta.drop:
            self.mover.drop(rid)
        for chunk in meta.out_chunks:
            self.mover.copy_out(chunk.key, chunk.block_ids, chunk.first, chunk.total)
        for rid, ids, first, source in meta.swap_in:
            self.mover.copy_in(source, ids, first)

    def wait_for_save(self) -> None:
        # The step's forward is queued: the next one waits (on the device) for the copies
        # out that ended this step, whose blocks the scheduler frees now.
        if self.mover is not None:
            self.mover.end_step()

    @property
    def host(self) -> dict[str, Any]:
        """Host copies held by this worker, by request id or host key."""
        return self.mover.host if self.mover is not None else {}

    @property
    def host_bytes(self) -> int:
        return self.mover.host_bytes if self.mover is not None else 0

    @property
    def stats(self) -> dict[str, Any]:
        """Blocks copied each way and seconds spent copying (landed chunks only)."""
        if self.mover is None:
            return {"out_blocks": 0, "in_blocks": 0, "out_s": 0.0, "in_s": 0.0}
        return self.mover.stats

    def get_kv_connector_stats(self) -> SwapCopyStats | None:
        """The copies landed since the last report (vLLM asks after every step), or None."""
        if self.mover is None:
            return None
        now = self.mover.stats
        delta = {k: now[k] - self._reported[k] for k in _COPY_KEYS}
        if not (delta["out_blocks"] or delta["in_blocks"]):
            return None
        self._reported = dict(now)
        return SwapCopyStats(delta)

    def shutdown(self) -> None:
        if self.mover is not None:
            self.mover.shutdown()

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        pass

"""Swap: a KV connector that copies a paused request's KV blocks to host memory and back.

Loaded by configuration (no vLLM file is touched):

    KVTransferConfig(kv_connector="HostSwapConnector", kv_role="kv_both",
                     kv_connector_module_path="marsched.vllm.kv_swap")

vLLM builds it twice: role SCHEDULER in the EngineCore (`scheduler.connector`,
driven by `MarsScheduler`) and role WORKER beside the model (it gets the KV tensors
in `register_kv_caches` and does the copies in `start_load_kv`).

Protocol (see docs/vllm-internals.md, "Swap"):
1. call starts: `queue_swap_out(rid, block_ids, tokens)`; the request keeps its blocks.
2. next step: the metadata carries the swap-out; the worker copies the blocks to host.
3. `update_from_output` of that step: the scheduler frees the device blocks.
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

import time
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)


def copy_blocks_out(kv_caches: dict[str, torch.Tensor], block_dim: dict[str, int], ids: list[int]) -> dict[str, torch.Tensor]:
    """Host copies of blocks `ids` of every layer (the Swap connector's swap-out; `calibrate` times it)."""
    copies = {}
    for name, kv in kv_caches.items():
        idx = torch.tensor(ids, dtype=torch.long, device=kv.device)
        copies[name] = kv.index_select(block_dim[name], idx).to("cpu", copy=True)
    return copies


def copy_blocks_in(kv_caches: dict[str, torch.Tensor], block_dim: dict[str, int], saved: dict[str, torch.Tensor],
                   ids: list[int], first: int = 0) -> None:
    """Write saved blocks `first`, `first + 1`, ... of every layer into device blocks `ids` (swap-in)."""
    for name, kv in kv_caches.items():
        dim = block_dim[name]
        src = saved[name].narrow(dim, first, len(ids)).to(kv.device)
        kv.index_copy_(dim, torch.tensor(ids, dtype=torch.long, device=kv.device), src)


@dataclass
class SwapMeta(KVConnectorMetadata):
    swap_out: list[tuple[str, list[int]]] = field(default_factory=list)
    # (request id, destination block ids, index of the first saved block to restore, host key of the copy)
    swap_in: list[tuple[str, list[int], int, str]] = field(default_factory=list)
    drop: list[str] = field(default_factory=list)
    # The scheduler's state after this step's schedule, for MarsWorkerExtension (the worker
    # may live in another process than the scheduler: on CPU vLLM always uses the mp executor).
    snapshot: dict[str, Any] | None = None


class HostSwapConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.block_size = vllm_config.cache_config.block_size
        self.num_blocks = getattr(kv_cache_config, "num_blocks", None)
        # scheduler side
        self._pending_out: dict[str, list[int]] = {}
        self._pending_in: dict[str, tuple[list[int], int, str]] = {}
        self._pending_drop: list[str] = []
        self.expect_load: dict[str, int] = {}  # rid -> tokens to restore
        self.load_from: dict[str, str] = {}  # rid -> host key of the copy it loads, when not its own
        self.host_tokens: dict[str, int] = {}  # rid -> tokens held on host (scheduler's account)
        self.last_swap_in: dict[str, int] = {}  # rid -> blocks restored, for the scheduler's trace
        self.snapshot_dirty = False  # the scheduler's state changed: run a step to publish it
        # worker side
        self.kv_caches: dict[str, torch.Tensor] = {}
        self._block_dim: dict[str, int] = {}
        self.host: dict[str, dict[str, torch.Tensor]] = {}
        self.scheduler_state: dict[str, Any] = {}
        self.request_info: dict[str, dict[str, Any]] = {}
        self.stats = {"out_blocks": 0, "in_blocks": 0, "out_s": 0.0, "in_s": 0.0}

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # we never hand KV to another engine

    # ---------------- scheduler side ----------------

    def queue_swap_out(self, req_id: str, block_ids: list[int], tokens: int) -> None:
        self._pending_out[req_id] = list(block_ids)
        self.host_tokens[req_id] = tokens

    def cancel_swap_out(self, req_id: str) -> bool:
        if self._pending_out.pop(req_id, None) is None:
            return False
        self.host_tokens.pop(req_id, None)
        return True

    def drop(self, req_id: str) -> None:
        """Forget a request's host copy (its device blocks are kept or gone)."""
        self.expect_load.pop(req_id, None)
        self.load_from.pop(req_id, None)
        self._pending_out.pop(req_id, None)
        self._pending_in.pop(req_id, None)
        if self.host_tokens.pop(req_id, None) is not None:
            self._pending_drop.append(req_id)

    @property
    def host_tokens_used(self) -> int:
        return sum(self.host_tokens.values())

    def has_pending_push_work(self) -> bool:
        # Keeps EngineCore stepping while only paused requests remain, so that a
        # queued swap-out (or a host-copy drop) reaches the worker.
        return bool(self._pending_out or self._pending_drop or self.snapshot_dirty)

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
        meta = SwapMeta(
            swap_out=list(self._pending_out.items()),
            swap_in=[(rid, ids, first, source) for rid, (ids, first, source) in self._pending_in.items()],
            drop=list(self._pending_drop),
        )
        self._pending_out.clear()
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
        for name, kv in kv_caches.items():
            # CPU attention: [num_blocks, 2, block_size, ...]; FlashAttention: [2, num_blocks, ...].
            dims = [d for d, n in enumerate(kv.shape) if n == self.num_blocks] if self.num_blocks else []
            self._block_dim[name] = dims[0] if dims else 0

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, SwapMeta)
        if meta.snapshot is not None:
            self.scheduler_state = meta.snapshot["state"]
            self.request_info.update(meta.snapshot["requests"])
            while len(self.request_info) > 10_000:
                self.request_info.pop(next(iter(self.request_info)))
        for rid in meta.drop:
            self.host.pop(rid, None)
        for rid, ids in meta.swap_out:
            started = time.perf_counter()
            self.host[rid] = copy_blocks_out(self.kv_caches, self._block_dim, ids)
            self.stats["out_blocks"] += len(ids)
            self.stats["out_s"] += time.perf_counter() - started
        for rid, ids, first, source in meta.swap_in:
            started = time.perf_counter()
            copy_blocks_in(self.kv_caches, self._block_dim, self.host.pop(source), ids, first)
            self.stats["in_blocks"] += len(ids)
            self.stats["in_s"] += time.perf_counter() - started
        if (meta.swap_out or meta.swap_in) and torch.cuda.is_available():
            torch.cuda.synchronize()

    @property
    def host_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for copies in self.host.values() for t in copies.values())

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        pass

    def wait_for_save(self) -> None:
        pass

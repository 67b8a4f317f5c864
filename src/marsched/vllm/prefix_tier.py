"""A host prefix tier for stock vLLM: a KV connector that keeps finished requests' full blocks in
host memory, keyed by vLLM's own block hashes, and loads them back on a later prefix hit.

Stock vLLM's scheduler and policy load it by configuration (no scheduler change):

    --kv-transfer-config '{"kv_connector": "HostPrefixTierConnector", "kv_role": "kv_both",
                           "kv_connector_module_path": "marsched.vllm.prefix_tier",
                           "kv_connector_extra_config": {"host_tokens": 4194304}}'

The capacity is one of `host_tokens`, `host_blocks` or `host_bytes` (bytes over every layer,
converted with the engine's KV-cache config); none: `MarsConfig.host_swap_tokens`, the host
memory `marsched serve` gives the Swap connector, so both compare on the same host memory.
`offload_prompt_only` (default true, as vLLM's OffloadingConnector): only blocks inside the
prompt are saved; false saves the reply's full blocks too.

It is what vLLM's `OffloadingConnector` does on GPUs (blocks stored by hash, LRU, loaded on a
prefix hit), which refuses to start on the CPU ("CPU Offloading is currently only supported on
CUDA-alike and XPU GPUs"), as does its `SimpleCPUOffloadConnector` (CUDA streams). The copies
are the Swap connector's (`kv_copy.KvMover`, one host copy per block; `kv_host.mover_for`).

Scheduler side (`PrefixStore`: which hashes the host holds, LRU):
1. `request_finished`: the request's full computed blocks (of its prompt, by default) not yet held
   are queued to save, tail
   first, so that a prefix is evicted from its tail as vLLM's free queue evicts; the store
   evicts least recently used blocks to stay within capacity. The request's blocks are freed
   only when the worker reports the copy done (`get_finished`), as vLLM's delayed free does, so
   that no later step writes them first: a step with no load copies after its forward.
2. `get_num_new_matched_tokens`: the held blocks that follow the device's prefix hit, by
   chained hash, consecutively, short of the prompt's last token (vLLM computes at least one).
3. `update_state_after_alloc`: those blocks' device ids become this step's loads; a synchronous
   load, so the worker copies them in before this step's forward.
4. `build_connector_meta`: saves, loads, evictions. The worker does them in that order: a block
   saved this step can be loaded in it, and an eviction never names a block loaded in its step.

Counters (`counts`, the scheduler side's): lookups, hits, blocks and tokens loaded, blocks saved
and evicted; logged at INFO in each step that loads, else at most every `LOG_EVERY_S` seconds when
they change, and at shutdown.
vLLM's own `vllm:external_prefix_cache_hits` (tokens) counts the same hits.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.logger import init_logger

from marsched.vllm.config import MarsConfig
from marsched.vllm.kv_copy import KvMover, Transfer
from marsched.vllm.kv_host import bytes_per_block, extra_config, mover_for
from marsched.vllm.kv_prefix_store import PrefixStore

# Under vLLM's logger: its handler prints INFO in the server's log; a marsched logger's would not show.
logger = init_logger(f"vllm.{__name__}")

CAPACITY_KEYS = ("host_tokens", "host_blocks", "host_bytes")
PROMPT_ONLY_KEY = "offload_prompt_only"  # vLLM's OffloadingConnector's name and default (true)
DEFAULT_HOST_TOKENS = MarsConfig().host_swap_tokens  # what `marsched serve` gives the Swap connector
LOG_EVERY_S = 10.0


def host_capacity_blocks(vllm_config: Any, kv_cache_config: Any, block_size: int) -> int:
    """The tier's capacity in blocks from `kv_connector_extra_config` (ValueError naming the key)."""
    extra = extra_config(vllm_config)
    given = {key: extra[key] for key in CAPACITY_KEYS if extra.get(key) is not None}
    if len(given) > 1:
        raise ValueError(f"kv_connector_extra_config: give one of {', '.join(CAPACITY_KEYS)}, not {sorted(given)}")
    key, value = next(iter(given.items()), ("host_tokens", DEFAULT_HOST_TOKENS))
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"kv_connector_extra_config.{key}: give a whole number >= 0, not {value!r}")
    if key == "host_blocks":
        return value
    if key == "host_tokens":
        return value // block_size
    per_block = bytes_per_block(kv_cache_config)
    if per_block <= 0:
        raise ValueError("kv_connector_extra_config.host_bytes: the engine's KV bytes per block are unknown")
    return value // per_block


def prompt_only(vllm_config: Any) -> bool:
    value = extra_config(vllm_config).get(PROMPT_ONLY_KEY, True)
    if not isinstance(value, bool):
        raise ValueError(f"kv_connector_extra_config.{PROMPT_ONLY_KEY}: give true or false, not {value!r}")
    return value


def block_key(block_hash: bytes) -> str:
    """The worker's name for a block: its hash as text (vLLM's BlockHash is bytes)."""
    return bytes(block_hash).hex()


@dataclass
class PrefixTierMeta(KVConnectorMetadata):
    # (request id, [(block key, device block id)]): copy out, then report the request done
    saves: list[tuple[str, list[tuple[str, int]]]] = field(default_factory=list)
    loads: list[tuple[str, int]] = field(default_factory=list)  # (block key, device block id): copy in
    evictions: list[str] = field(default_factory=list)  # block keys to forget


@dataclass
class TierCounts:
    lookups: int = 0  # requests asked about (each admission try)
    hits: int = 0  # admissions that loaded at least one block
    loaded_blocks: int = 0
    loaded_tokens: int = 0
    saved_blocks: int = 0
    evicted_blocks: int = 0


class HostPrefixTierConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.block_size = vllm_config.cache_config.block_size
        self.num_blocks = getattr(kv_cache_config, "num_blocks", None)
        groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
        if len(groups) > 1:  # one block table: block i of a request is hash i of its prefix
            raise ValueError(f"HostPrefixTierConnector: one KV-cache group only, not {len(groups)}")
        hash_size = getattr(kv_cache_config, "hash_block_size", None)
        if hash_size not in (None, self.block_size):
            raise ValueError(f"HostPrefixTierConnector: block hashes of {hash_size} tokens, blocks of "
                             f"{self.block_size}: one hash per block needed")
        # scheduler side
        capacity = (host_capacity_blocks(vllm_config, kv_cache_config, self.block_size)
                    if role == KVConnectorRole.SCHEDULER else 0)
        self.store = PrefixStore(capacity)
        self.prompt_only = prompt_only(vllm_config)
        self.counts = TierCounts()
        self._looked_up: dict[str, int] = {}  # request id -> first block after its device hit
        self._saves: dict[str, dict[str, int]] = {}  # request id -> {block key: device block} to copy out
        self._save_owner: dict[str, str] = {}  # block key -> the request whose save carries it
        self._loads: list[tuple[str, int]] = []
        self._evicting: set[str] = set()  # block keys the worker still holds and must forget
        self._logged: tuple[int, ...] = ()
        self._logged_at = 0.0
        if role == KVConnectorRole.SCHEDULER:
            logger.info("host prefix tier: %d blocks of %d tokens, %s", capacity, self.block_size,
                        "prompt blocks only" if self.prompt_only else "prompt and reply blocks")
        # worker side
        self.mover: KvMover | None = None
        self._sending: dict[str, list[Transfer]] = {}  # request id -> its save's copies

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a lost save is a later miss, never lost output

    # ---------------- scheduler side ----------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        start = num_computed_tokens // self.block_size  # the device hit vLLM presents is block-aligned
        stop = min(len(request.block_hashes), (request.num_tokens - 1) // self.block_size)
        self._looked_up[request.request_id] = start
        self.counts.lookups += 1
        return self.store.match(request.block_hashes, start, stop) * self.block_size, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        start = self._looked_up.pop(request.request_id, None)
        if start is None or num_external_tokens <= 0:
            return
        n = num_external_tokens // self.block_size
        hashes = request.block_hashes[start:start + n]
        ids = blocks.get_block_ids()[0][start:start + n]
        if len(ids) != n or self.store.match(hashes, 0, n) != n:  # nothing evicts between lookup and here
            raise RuntimeError(f"host prefix tier: request {request.request_id}: {n} blocks from {start} "
                               f"matched, {len(ids)} allocated, {self.store.match(hashes, 0, n)} held")
        self._loads += [(block_key(h), block_id) for h, block_id in zip(hashes, ids)]
        self.store.touch(reversed(hashes))  # the prefix's head ends the most recent
        self.counts.hits += 1
        self.counts.loaded_blocks += n
        self.counts.loaded_tokens += n * self.block_size

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._looked_up.pop(rid, None)
        # Blocks whose every token's KV is written: tokens still in flight are not.
        written = request.num_computed_tokens - getattr(request, "num_in_flight_tokens", 0)
        if self.prompt_only:
            written = min(written, request.num_prompt_tokens)
        full = min(len(request.block_hashes), len(block_ids), max(written, 0) // self.block_size)
        saves: dict[str, int] = {}
        for i in reversed(range(full)):  # tail first: the head ends the most recent, evicted last
            key = block_key(request.block_hashes[i])
            new, evicted = self.store.put(request.block_hashes[i])
            for old in evicted:
                self._evict(block_key(old), saves)
            if new:
                if key in self._evicting:  # evicted, not yet forgotten by the worker: it still holds it
                    self._evicting.discard(key)
                else:
                    saves[key] = block_ids[i]
                    self._save_owner[key] = rid
        if not saves:
            return False, None
        self._saves[rid] = saves
        self.counts.saved_blocks += len(saves)
        return True, None  # freed when the worker reports the copy done (get_finished)

    def _evict(self, key: str, saving_now: dict[str, int]) -> None:
        self.counts.evicted_blocks += 1
        if key in saving_now:  # this request's own block, evicted before its save was queued
            del saving_now[key]
            self._save_owner.pop(key, None)
        elif key in self._save_owner:  # queued, not yet sent: do not send it
            owner = self._save_owner.pop(key)
            del self._saves[owner][key]
            self.counts.saved_blocks -= 1
        else:
            self._evicting.add(key)

    def build_connector_meta(self, scheduler_output: Any) -> PrefixTierMeta:
        meta = PrefixTierMeta(saves=[(rid, list(saves.items())) for rid, saves in self._saves.items()],
                              loads=self._loads, evictions=sorted(self._evicting))
        self._saves, self._save_owner, self._loads, self._evicting = {}, {}, [], set()
        self._log_counts(force=bool(meta.loads))  # every step with a hit, else now and then
        return meta

    def has_pending_push_work(self) -> bool:
        # Keeps the engine stepping until queued evictions reach the worker and free host memory
        # (a queued save delays a finished request's free, which keeps it stepping anyway).
        return bool(self._saves or self._evicting)

    def _log_counts(self, force: bool = False) -> None:
        now = time.monotonic()
        counts = tuple(asdict(self.counts).values())
        if counts != self._logged and (force or now - self._logged_at >= LOG_EVERY_S):
            self._logged, self._logged_at = counts, now
            logger.info("host prefix tier: %s; %d of %d blocks held", self.summary(), len(self.store),
                        self.store.capacity)

    def summary(self) -> str:
        c = self.counts
        return (f"{c.hits} hits of {c.lookups} lookups, {c.loaded_blocks} blocks ({c.loaded_tokens} tokens) "
                f"loaded, {c.saved_blocks} saved, {c.evicted_blocks} evicted")

    # ---------------- worker side ----------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.mover = mover_for(self._vllm_config, kv_caches, self.num_blocks)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, PrefixTierMeta)
        if self.mover is None:
            if meta.loads:
                raise RuntimeError("HostPrefixTierConnector: a load was asked for before the KV caches were registered")
            self._sending.update((rid, []) for rid, _ in meta.saves)  # nothing to copy: done
            return
        for rid, saves in meta.saves:
            self._sending[rid] = [self.mover.copy_out(key, [block_id]) for key, block_id in saves]
        for key, block_id in meta.loads:
            self.mover.copy_in(key, [block_id], keep=True)
        for key in meta.evictions:
            self.mover.drop(key)

    def wait_for_save(self) -> None:
        if self.mover is not None:
            self.mover.end_step()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        done = {rid for rid, copies in self._sending.items() if all(c.done for c in copies)}
        for rid in done:
            del self._sending[rid]
        return done or None, None

    @property
    def host_bytes(self) -> int:
        return self.mover.host_bytes if self.mover is not None else 0

    def shutdown(self) -> None:
        if self._role == KVConnectorRole.SCHEDULER:
            self._log_counts(force=True)
        if self.mover is not None:
            self.mover.shutdown()

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass  # the loads are done (on CUDA: ordered before the forward) in start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        pass  # blocks are saved whole when their request ends, not layer by layer

"""The device's free blocks as vLLM V1 keeps them: a queue in the order they were freed, in
which a request's full blocks keep their content until they are handed out again.

vLLM V1's automatic prefix caching (on by default) does not wipe a freed block: it goes to
the tail of the free queue with its content's hash, and a later request whose prefix hashes
the same takes it back instead of computing it again (`KVCacheManager.get_computed_blocks`).
A block is handed out from the head of the queue (`BlockPool.get_new_blocks`), and if it
still held content that content is gone (evicted): least recently freed first. A request's
full blocks are freed to the tail, tail block first (`KVCacheManager.free`,
`BlockPool.free_blocks`), so its last blocks are evicted before its first ones and what
survives of a request is always a prefix of its blocks. A block that is not full has no hash:
it goes to the head and is handed out first.

Content identity here is the request's own context: in the simulator's workloads no two
requests share a prefix, so a request can only take back blocks it freed itself (at a
discarded call, a preemption, a swap-out once the host has the copy, or stock vLLM's end at the
call). The queue is kept as the blocks without a hash at its head, then runs of full blocks
freed together: per run, `dead` blocks (content no one will ask for: a finished request's, the
remains of a run that was taken back) followed by `cached` leading blocks of one request, in
queue order (the request's tail block first).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from marsched.sim.memory import BlockPool


@dataclass(slots=True, eq=False)
class _Run:
    owner: str | None  # the request whose leading blocks `cached` are; None: nothing cached
    dead: int  # blocks at the run's head with no content worth keeping
    cached: int  # the owner's blocks 0..cached-1, freed tail first, so block 0 is the run's last

    @property
    def blocks(self) -> int:
        return self.dead + self.cached


@dataclass(slots=True)
class FreeBlockQueue:
    """The free blocks of one device pool, oldest-freed first (`free` of them in all)."""

    free: int
    _runs: OrderedDict[int, _Run] = field(default_factory=OrderedDict)  # queue order
    _run_of: dict[str, int] = field(default_factory=dict)  # request id -> its cached run's id
    _next_id: int = 0
    cached_blocks: int = 0  # blocks in the queue that still hold a request's prefix
    _unhashed: int = field(init=False)  # blocks at the head with no content (never used, or not full)

    def __post_init__(self) -> None:
        self._unhashed = self.free

    def _append(self, owner: str | None, dead: int, cached: int) -> None:
        if owner is None and self._runs:
            last = next(reversed(self._runs.values()))
            if last.cached == 0:  # a dead run after a dead run: one run
                last.dead += dead
                return
        self._runs[self._next_id] = _Run(owner, dead, cached)
        if owner is not None:
            self._run_of[owner] = self._next_id
        self._next_id += 1

    # --- blocks coming back -----------------------------------------------------------

    def release(self, owner: str | None, blocks: int, full_blocks: int = 0) -> None:
        """`blocks` blocks come back; the first `full_blocks` of them are full (hashed): they go to
        the tail, as `owner`'s cached prefix (no owner: content no one will ask for). The others
        go to the head."""
        if blocks < 0 or not 0 <= full_blocks <= blocks:
            raise ValueError(f"free queue: cannot take back {blocks} blocks with {full_blocks} full")
        self._unhashed += blocks - full_blocks
        if owner is not None and full_blocks:
            self.forget(owner)  # an older copy of the same prefix is stale now
            self._append(owner, 0, full_blocks)
            self.cached_blocks += full_blocks
        elif full_blocks:
            self._append(None, full_blocks, 0)
        self.free += blocks

    # --- blocks handed out ------------------------------------------------------------

    def allocate(self, blocks: int) -> None:
        """Hand out `blocks` blocks from the head: what they held is evicted."""
        if blocks < 0 or blocks > self.free:
            raise RuntimeError(f"free queue: cannot hand out {blocks} blocks with {self.free} free")
        self.free -= blocks
        from_head = min(blocks, self._unhashed)
        self._unhashed -= from_head
        blocks -= from_head
        while blocks:
            run_id, run = next(iter(self._runs.items()))
            if blocks >= run.blocks:
                blocks -= run.blocks
                self.cached_blocks -= run.cached
                del self._runs[run_id]
                if run.owner is not None:
                    del self._run_of[run.owner]
                continue
            from_dead = min(blocks, run.dead)
            run.dead -= from_dead
            run.cached -= blocks - from_dead  # the owner's tail blocks go first
            self.cached_blocks -= blocks - from_dead
            blocks = 0

    def cached(self, owner: str) -> int:
        """How many of `owner`'s leading blocks are still cached."""
        run_id = self._run_of.get(owner)
        return 0 if run_id is None else self._runs[run_id].cached

    def take(self, owner: str, limit: int) -> int:
        """`owner` takes back up to `limit` of its cached leading blocks (a prefix hit); they leave
        the queue. What it does not take back stays, with nothing worth keeping."""
        run_id = self._run_of.pop(owner, None)
        if run_id is None:
            return 0
        run = self._runs[run_id]
        hit = min(run.cached, max(limit, 0))
        self.cached_blocks -= run.cached
        run.owner = None
        run.dead += run.cached - hit
        run.cached = 0
        self.free -= hit
        if run.dead == 0:
            del self._runs[run_id]
        return hit

    def truncate(self, owner: str, keep_blocks: int) -> None:
        """`owner`'s content past its first `keep_blocks` blocks changed (a compaction)."""
        run_id = self._run_of.get(owner)
        if run_id is None:
            return
        run = self._runs[run_id]
        drop = max(run.cached - max(keep_blocks, 0), 0)
        run.cached -= drop
        run.dead += drop
        self.cached_blocks -= drop
        if run.cached == 0:
            run.owner = None
            del self._run_of[owner]

    def forget(self, owner: str) -> None:
        """`owner` ended: its cached blocks can never be taken back."""
        self.truncate(owner, 0)

    def check(self) -> None:
        """The queue adds up (tests and audits)."""
        total = self._unhashed + sum(r.blocks for r in self._runs.values())
        cached = sum(r.cached for r in self._runs.values())
        if total != self.free or cached != self.cached_blocks or any(r.dead < 0 or r.cached < 0 for r in self._runs.values()):
            raise AssertionError(f"free queue: {total} blocks in runs, {self.free} free; {cached} cached, "
                                 f"{self.cached_blocks} counted")
        owners = {r.owner: i for i, r in self._runs.items() if r.owner is not None}
        if owners != self._run_of or any(r.cached == 0 for r in self._runs.values() if r.owner is not None):
            raise AssertionError("free queue: the owners' runs do not match the index")


class CachingBlockPool(BlockPool):
    """A device pool whose free blocks keep their content (`FreeBlockQueue`): vLLM V1 with
    prefix caching on."""

    __slots__ = ("queue",)

    def __init__(self, name: str, capacity: int) -> None:
        super().__init__(name, capacity)
        self.queue = FreeBlockQueue(capacity)

    def allocate(self, blocks: int) -> None:
        BlockPool.allocate(self, blocks)
        self.queue.allocate(blocks)

    def release(self, blocks: int, owner: str | None = None, full_blocks: int = 0) -> None:
        BlockPool.release(self, blocks)
        self.queue.release(owner, blocks, full_blocks)

    def take_back(self, owner: str, limit: int) -> int:
        """`owner`'s cached leading blocks, up to `limit`, in use again (a prefix hit)."""
        hit = self.queue.take(owner, limit)
        self.used += hit
        return hit


@dataclass(slots=True)
class HostPrefixTier:
    """Host memory as vLLM's CPU offloading keeps it (the OffloadingConnector,
    `vllm/v1/kv_offload/`): requests' leading full blocks stored by content, least recently
    stored evicted first (its default `lru` policy), a request's tail first. What a finished
    request stored stays until evicted: no one will ask for it, but it takes room."""

    capacity: int
    _runs: OrderedDict[int, int] = field(default_factory=OrderedDict)  # run -> stored blocks, LRU first
    _run_of: dict[str, int] = field(default_factory=dict)  # owner -> its run, while it can be hit
    _owner_of: dict[int, str] = field(default_factory=dict)  # the same, the other way
    _next_id: int = 0
    used: int = 0

    def stored(self, owner: str) -> int:
        run = self._run_of.get(owner)
        return 0 if run is None else self._runs[run]

    def store(self, owner: str, blocks: int) -> None:
        """`owner`'s first `blocks` blocks are on the host (as many as it had, if more); most recent now."""
        blocks = min(max(blocks, self.stored(owner)), self.capacity)
        old = self._run_of.pop(owner, None)
        if old is not None:
            self.used -= self._runs.pop(old)
            del self._owner_of[old]
        while self.used + blocks > self.capacity:
            head, count = next(iter(self._runs.items()))
            evict = min(count, self.used + blocks - self.capacity)
            self.used -= evict
            if evict < count:
                self._runs[head] = count - evict
                continue
            del self._runs[head]
            name = self._owner_of.pop(head, None)
            if name is not None:
                del self._run_of[name]
        if blocks:
            self._runs[self._next_id] = blocks
            self._run_of[owner] = self._next_id
            self._owner_of[self._next_id] = owner
            self._next_id += 1
            self.used += blocks

    def truncate(self, owner: str, keep_blocks: int) -> None:
        """`owner`'s content past its first `keep_blocks` blocks changed (a compaction)."""
        run = self._run_of.get(owner)
        if run is None or self._runs[run] <= keep_blocks:
            return
        self.used -= self._runs[run] - max(keep_blocks, 0)
        if keep_blocks > 0:
            self._runs[run] = keep_blocks
        else:
            del self._runs[run]
            del self._run_of[owner]
            del self._owner_of[run]

    def retire(self, owner: str) -> None:
        """`owner` ended: its blocks stay, in their place, where no one can hit them."""
        run = self._run_of.pop(owner, None)
        if run is not None:
            del self._owner_of[run]

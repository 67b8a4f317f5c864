"""Which KV blocks a host prefix tier holds: block hashes in least-recently-used order, at most a
fixed number of blocks.

Pure Python (no vLLM, no torch): the scheduler side of `prefix_tier.HostPrefixTierConnector`
keeps one, and the worker side holds the bytes and does what the store decided. A key is one
full block's hash as vLLM's prefix cache chains it (a block's hash covers every token before it),
so a request's blocks match only from its first one, consecutively, as the prefix cache's do.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence


class PrefixStore:
    def __init__(self, capacity_blocks: int) -> None:
        if isinstance(capacity_blocks, bool) or not isinstance(capacity_blocks, int) or capacity_blocks < 0:
            raise ValueError(f"host prefix tier: capacity {capacity_blocks!r}: give a whole number of blocks >= 0")
        self.capacity = capacity_blocks
        self._keys: OrderedDict[Hashable, None] = OrderedDict()  # least recently used first

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._keys

    def match(self, keys: Sequence[Hashable], start: int, stop: int) -> int:
        """How many of `keys[start:stop]` are held, consecutively from `start` (order unchanged)."""
        n = 0
        for key in keys[start:max(stop, start)]:
            if key not in self._keys:
                break
            n += 1
        return n

    def touch(self, keys: Iterable[Hashable]) -> None:
        """Mark held `keys` used now, the last given the most recent."""
        for key in keys:
            if key in self._keys:
                self._keys.move_to_end(key)

    def put(self, key: Hashable) -> tuple[bool, list[Hashable]]:
        """Hold `key` as the most recent: (whether it is new, the keys evicted to make room). A key
        already held is only touched; with no capacity nothing is held."""
        if key in self._keys:
            self._keys.move_to_end(key)
            return False, []
        if self.capacity == 0:
            return False, []
        evicted = []
        while len(self._keys) >= self.capacity:
            evicted.append(self._keys.popitem(last=False)[0])
        self._keys[key] = None
        return True, evicted

    def lru_order(self) -> list[Hashable]:
        """The held keys, least recently used first (for tests and logs)."""
        return list(self._keys)

"""Paged KV memory: a pool of fixed-size blocks, on the device or in host memory."""

from __future__ import annotations

from dataclasses import dataclass


def blocks_for(tokens: int, block_tokens: int) -> int:
    return -(-tokens // block_tokens)


@dataclass(slots=True)
class BlockPool:
    name: str
    capacity: int
    used: int = 0

    @property
    def free(self) -> int:
        return self.capacity - self.used

    def allocate(self, blocks: int) -> None:
        if blocks < 0 or blocks > self.free:
            raise RuntimeError(f"{self.name} pool: cannot allocate {blocks} blocks with {self.free} free")
        self.used += blocks

    def release(self, blocks: int) -> None:
        if blocks < 0 or blocks > self.used:
            raise RuntimeError(f"{self.name} pool: cannot release {blocks} blocks with {self.used} in use")
        self.used -= blocks

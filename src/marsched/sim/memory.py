"""Paged KV memory: a pool of fixed-size blocks, on the device or in host memory."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from marsched.sim.profile import Profile
    from marsched.workload.model import Request


def blocks_for(tokens: int, block_tokens: int) -> int:
    return -(-tokens // block_tokens)


def check_fits(requests: list[Request], profile: Profile) -> None:
    """Every request fits the device at its longest (its final context and the token after it)."""
    for request in requests:
        needed = blocks_for(request.final_context_tokens + 1, profile.block_tokens)
        if needed > profile.device_blocks:
            raise ValueError(
                f"request {request.request_id!r} needs {needed} KV blocks at its longest, "
                f"more than the {profile.device_blocks} the profile {profile.name!r} has"
            )


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

"""The simulator's block accounting, checked (tests and audits call it between steps)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from marsched.sim.memory import blocks_for

if TYPE_CHECKING:
    from marsched.sim.engine import Simulator


def check_invariants(sim: "Simulator") -> None:
    """Every block in use is held by a live request, pools stay in capacity, and a request's
    computed tokens fit in the blocks it holds."""
    device = sum(r.device_blocks for r in sim.live.values())
    host = sum(r.host_blocks for r in sim.live.values())
    if device != sim.device.used or host != sim.host.used:
        raise AssertionError(
            f"block accounting: device {sim.device.used} in use vs {device} held; host {sim.host.used} vs {host}"
        )
    if not (0 <= sim.device.used <= sim.device.capacity and 0 <= sim.host.used <= sim.host.capacity):
        raise AssertionError("block pool outside its capacity")
    queue = getattr(sim.device, "queue", None)
    if queue is not None:  # the prefix cache's free queue holds exactly the free blocks
        queue.check()
        if queue.free != sim.device.free:
            raise AssertionError(f"free queue holds {queue.free} blocks, the pool has {sim.device.free} free")
    for r in sim.live.values():
        p = r.progress
        held = r.device_blocks + r.host_blocks if r.transfer is None else r.device_blocks
        if r.device_blocks and blocks_for(p.computed_tokens, sim.block_tokens) > held:
            raise AssertionError(f"{r.rid}: {p.computed_tokens} computed tokens in {held} blocks")

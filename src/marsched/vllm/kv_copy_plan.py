"""Which swap-out blocks go to the worker in each engine step: a per-step budget, first come first served.

Pure Python. The scheduler side of the Swap connector owns one `OutPlanner`: a queued copy
is cut into chunks of at most `blocks_per_step` blocks in all per step (None: no limit, so
every copy goes whole in the step after it was queued, as before budgets existed). A copy
counts as sent in the step that carries its last chunk: only then may its device blocks be
freed, and only then does the scheduler hear of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


@dataclass(frozen=True, slots=True)
class OutChunk:
    """Blocks `first` .. `first + len(block_ids) - 1` of the `total`-block copy `key`."""

    key: str
    total: int
    first: int
    block_ids: tuple[int, ...]

    @property
    def last(self) -> bool:
        return self.first + len(self.block_ids) == self.total


class Cancelled(Enum):
    NOTHING = "nothing"  # no copy of the key was waiting
    UNSENT = "unsent"  # none of it had reached the worker
    PARTIAL = "partial"  # some chunks had: the worker holds a partial copy to drop


@dataclass(slots=True)
class _Queued:
    block_ids: list[int]
    sent: int = 0


def check_budget(blocks_per_step: int | None, what: str = "blocks_per_step") -> int | None:
    if blocks_per_step is None:
        return None
    if isinstance(blocks_per_step, bool) or not isinstance(blocks_per_step, int) or blocks_per_step < 1:
        raise ValueError(f"{what}: give a whole number of blocks >= 1 (or none for no limit), "
                         f"not {blocks_per_step!r}")
    return blocks_per_step


def blocks_per_step(blocks: int | None, bytes_: int | None, bytes_per_block: int) -> int | None:
    """The step budget in blocks from a budget in blocks and/or bytes (the smaller; at least one
    block, so that a copy always moves)."""
    limits = [blocks] if blocks is not None else []
    if bytes_ is not None:
        if bytes_per_block <= 0:
            raise ValueError(f"a byte budget needs the bytes per block, not {bytes_per_block!r}")
        limits.append(max(bytes_ // bytes_per_block, 1))
    return min(limits) if limits else None


class OutPlanner:
    def __init__(self, blocks_per_step: int | None = None) -> None:
        self.blocks_per_step = check_budget(blocks_per_step)
        self._queued: dict[str, _Queued] = {}  # insertion order is the order served

    def queue(self, key: str, block_ids: list[int]) -> None:
        """Copy `block_ids` out under `key`; a copy already queued under it starts over."""
        self._queued.pop(key, None)
        self._queued[key] = _Queued(list(block_ids))

    def cancel(self, key: str) -> Cancelled:
        queued = self._queued.pop(key, None)
        if queued is None:
            return Cancelled.NOTHING
        return Cancelled.PARTIAL if queued.sent else Cancelled.UNSENT

    def __contains__(self, key: str) -> bool:
        return key in self._queued

    def __bool__(self) -> bool:
        return bool(self._queued)

    def take_step(self) -> list[OutChunk]:
        """This step's chunks; the copies whose last chunk is among them leave the queue."""
        left = self.blocks_per_step
        chunks = []
        for key, queued in list(self._queued.items()):
            if left is not None and left <= 0:
                break
            remaining = len(queued.block_ids) - queued.sent
            n = remaining if left is None else min(remaining, left)
            chunks.append(OutChunk(key, len(queued.block_ids), queued.sent,
                                   tuple(queued.block_ids[queued.sent:queued.sent + n])))
            queued.sent += n
            if left is not None:
                left -= n
            if queued.sent == len(queued.block_ids):
                del self._queued[key]
        return chunks

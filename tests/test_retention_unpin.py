"""A kept turn's blocks go back to vLLM's free queue tail block first (`ConversationKeeper._unpin`), as
vLLM frees a request's own, so what survives of a released or expired turn is a prefix its follow-up
can still hit. Without vLLM: the pool below keeps vLLM's free-queue order (`BlockPool.free_blocks`
appends hashed blocks in the order given; `get_new_blocks` hands out the queue's head)."""

from __future__ import annotations

from marsched.policy import Strategy
from marsched.vllm.retention import ConversationKeeper


class Block:
    def __init__(self, block_id: int) -> None:
        self.block_id, self.block_hash, self.ref_cnt = block_id, f"h{block_id}", 1


class FreeQueuePool:
    def __init__(self) -> None:
        self.free: list[Block] = []  # head first: handed out first

    def touch(self, blocks):
        for b in blocks:
            if b.ref_cnt == 0:
                self.free.remove(b)
            b.ref_cnt += 1

    def free_blocks(self, ordered_blocks):
        for b in ordered_blocks:
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                self.free.append(b)

    def get_new_blocks(self, n: int) -> list[Block]:
        taken, self.free = self.free[:n], self.free[n:]
        for b in taken:
            b.block_hash, b.ref_cnt = None, 1  # evicted: its content is gone
        return taken


def cached_prefix(blocks: list[Block]) -> int:
    """Leading blocks a prefix lookup still finds (it stops at the first one evicted)."""
    return next((i for i, b in enumerate(blocks) if b.block_hash is None), len(blocks))


def kept_turn(strategy_end: str) -> tuple[FreeQueuePool, list[Block]]:
    pool = FreeQueuePool()
    keeper = ConversationKeeper(pool, 4, None)
    blocks = [Block(i) for i in range(4)]
    assert keeper.keep("c", "r1", list(range(16)), 16, blocks, Strategy.PRESERVE, 0.0, 1.0) is not None
    pool.free_blocks(list(reversed(blocks)))  # the finished turn's own references, as vLLM drops them
    if strategy_end == "expired":
        assert keeper.expire(2.0) == 1
    else:
        assert keeper.relieve(0, 4) == 1
    return pool, blocks


def test_a_released_or_expired_turn_keeps_a_prefix_when_some_of_its_blocks_are_reused():
    for end in ("expired", "released"):
        pool, blocks = kept_turn(end)
        assert [b.block_id for b in pool.free] == [3, 2, 1, 0]  # tail first: block 0 is evicted last
        pool.get_new_blocks(1)  # the next allocation reuses one block
        assert cached_prefix(blocks) == 3, end  # head first, block 0 would go and with it the whole prefix

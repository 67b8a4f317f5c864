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

    def evict_blocks(self, block_ids):
        for b in self.free:
            if b.block_id in block_ids:
                b.block_hash = None

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


class Swapper:
    def __init__(self) -> None:
        self.expect_load, self.load_from, self.dropped = {}, {}, []

    def queue_swap_out(self, key, block_ids, tokens):
        pass

    def cancel_swap_out(self, key):
        return False  # already on its way

    def drop(self, key):
        self.dropped.append(key)


def test_a_claimed_follow_up_holds_its_kept_prefix_until_it_is_given_up():
    """What a waiting follow-up will find (`reusable`): the kept prefix it shares, in whole blocks,
    short of its last token; nothing once its pinned blocks go to the head of the queue."""
    pool = FreeQueuePool()
    keeper = ConversationKeeper(pool, 4, None)
    blocks = [Block(i) for i in range(4)]
    keeper.keep("c", "r1", list(range(16)), 16, blocks, Strategy.PRESERVE, 0.0, 10.0)
    assert keeper.reusable("f") == 0  # nothing claimed
    keeper.claim("c", "f", list(range(14)) + [99, 98, 97], 1.0)  # shares 14 tokens: 3 whole blocks
    assert keeper.reusable("f") == 12
    keeper.relieve(0, 8, head_rid="head")  # the head needs room: the follow-up's pins go
    assert keeper.reusable("f") == 0
    keeper.keep("d", "r2", list(range(16)), 16, [Block(i) for i in range(4, 8)], Strategy.PRESERVE, 2.0, 10.0)
    keeper.claim("d", "g", list(range(16)), 3.0)  # the same 16 tokens: the last one is computed
    assert keeper.reusable("g") == 12
    keeper.scheduled("g", 12)
    assert keeper.reusable("g") == 0


def test_a_follow_up_of_a_turn_copied_to_the_host_is_loaded_from_there():
    pool = FreeQueuePool()
    swapper = Swapper()
    keeper = ConversationKeeper(pool, 4, swapper)
    blocks = [Block(i) for i in range(4)]
    keeper.keep("c", "r1", list(range(16)), 16, blocks, Strategy.SWAP, 0.0, 10.0)
    keeper.copy_sent(keeper.kept["c"].host_key, "step")
    keeper.copies_done("step")  # on the host only now
    keeper.claim("c", "f", list(range(20)), 1.0)
    assert keeper.reusable("f") == 16
    assert swapper.expect_load["f"] == 16 and swapper.load_from["f"] == keeper.claims["f"].host_key

"""The simulator's prefix cache (`sim/prefix_cache.py`): its free queue against a block-by-block
reference of vLLM V1's, hand-worked LRU evictions, and whole runs that conserve every block."""

from __future__ import annotations

import random

import pytest

from marsched.bench.runner import RunSpec, run_one
from marsched.policy.registry import POLICY_NAMES, make_policy
from marsched.sim.engine import Simulator
from marsched.sim.prefix_cache import CachingBlockPool, FreeBlockQueue, HostPrefixTier
from marsched.sim.profile import load_profile, scale_kv_capacity
from marsched.sim.select import make_simulator
from marsched.workload.loader import load_trace
from marsched.workload.arrivals import poisson_arrivals
from marsched.workload.model import ApiCall, ApiType, build_request
from tests.test_engine_semantics import Recorder


class ReferenceQueue:
    """vLLM V1's free block queue, one block at a time: a list (head first) of block ids, each
    block's content (owner, index) or None; blocks are handed out from the head; full blocks are
    freed to the tail, a request's tail block first, the others to the head."""

    def __init__(self, blocks: int) -> None:
        self.queue = list(range(blocks))
        self.content: dict[int, tuple[str, int] | None] = dict.fromkeys(self.queue)
        self.held: dict[str, list[int]] = {}

    def allocate(self, owner: str, n: int) -> None:
        taken, self.queue = self.queue[:n], self.queue[n:]
        for block in taken:
            self.content[block] = None  # evicted
        self.held.setdefault(owner, []).extend(taken)

    def _invalidate(self, owner: str, from_index: int = 0) -> None:
        for block in self.queue:
            c = self.content[block]
            if c is not None and c[0] == owner and c[1] >= from_index:
                self.content[block] = None

    def release(self, owner: str, full: int, finished: bool = False) -> None:
        self._invalidate(owner)
        blocks = self.held.pop(owner, [])
        for index, block in enumerate(blocks):
            self.content[block] = (owner, index) if index < full and not finished else None
        self.queue = list(reversed(blocks[full:])) + self.queue + list(reversed(blocks[:full]))

    def cached(self, owner: str) -> int:
        present = {self.content[b][1] for b in self.queue if self.content[b] and self.content[b][0] == owner}
        count = 0
        while count in present:
            count += 1
        return count

    def take(self, owner: str, limit: int) -> int:
        hit = min(self.cached(owner), limit)
        by_index = {self.content[b][1]: b for b in self.queue if self.content[b] and self.content[b][0] == owner}
        blocks = [by_index[i] for i in range(hit)]
        self.queue = [b for b in self.queue if b not in blocks]
        self._invalidate(owner)
        for block in blocks:
            self.content[block] = None
        self.held[owner] = blocks
        return hit

    def truncate(self, owner: str, keep: int) -> None:
        self._invalidate(owner, keep)

    @property
    def cached_blocks(self) -> int:
        return sum(1 for b in self.queue if self.content[b] is not None)


@pytest.mark.parametrize("seed", range(40))
def test_free_queue_hits_equal_a_block_by_block_reference(seed: int) -> None:
    rng = random.Random(seed)
    capacity = rng.randint(8, 60)
    ours, ref = FreeBlockQueue(capacity), ReferenceQueue(capacity)
    held: dict[str, int] = {}  # owner -> blocks it holds, as the engine tracks them
    owners = [f"r{i}" for i in range(6)]
    for _ in range(300):
        owner = rng.choice(owners)
        op = rng.random()
        if owner in held:
            if op < 0.5 and ours.free:  # grows
                n = rng.randint(1, ours.free)
                ours.allocate(n)
                ref.allocate(owner, n)
                held[owner] += n
            else:  # frees: some of its leading blocks full (a partial last block is not cached)
                full = rng.randint(0, held[owner])
                finished = rng.random() < 0.2  # its content is of no use to anyone
                ours.release(None if finished else owner, held.pop(owner), full)
                ref.release(owner, full, finished)
        elif op < 0.5:  # admitted: takes back what it can (a hit capped like the last token's block)
            limit = rng.randint(0, 20)
            hit = ours.take(owner, limit)
            assert hit == ref.take(owner, limit)
            held[owner] = hit
            n = rng.randint(0, ours.free)
            ours.allocate(n)
            ref.allocate(owner, n)
            held[owner] += n
        elif op < 0.7:
            keep = rng.randint(0, 10)
            ours.truncate(owner, keep)
            ref.truncate(owner, keep)
        elif op < 0.75:
            ours.forget(owner)
            ref.truncate(owner, 0)
        ours.check()
        assert ours.free == len(ref.queue)
        assert ours.cached_blocks == ref.cached_blocks
        for o in owners:
            assert ours.cached(o) == ref.cached(o), o


def test_lru_eviction_takes_the_least_recently_freed_tail_first() -> None:
    """Hand-worked: 10 blocks. a holds 4 (3 full), b holds 3 (3 full), both free (a first), then
    5 blocks are handed out: a's partial block (no hash: to the head) and the 3 never used go
    first, then a's last full block (its block 2). a keeps blocks 0-1, b all 3."""
    pool = CachingBlockPool("device", 10)
    pool.allocate(4)  # a
    pool.allocate(3)  # b
    pool.release(4, "a", 3)
    pool.release(3, "b", 3)
    assert (pool.queue.cached("a"), pool.queue.cached("b"), pool.free) == (3, 3, 10)
    pool.allocate(5)
    assert (pool.queue.cached("a"), pool.queue.cached("b")) == (2, 3)
    pool.allocate(2)  # a's blocks 1 and 0
    assert (pool.queue.cached("a"), pool.queue.cached("b")) == (0, 3)
    assert pool.take_back("b", 2) == 2  # the hit is capped; b's block 2 stays, worth nothing now
    assert (pool.used, pool.queue.cached_blocks, pool.queue.cached("b")) == (9, 0, 0)
    pool.queue.check()


def _one_call_request(rid: str, arrival_s: float, prompt: int = 64, out: int = 8, call_s: float = 5.0):
    return build_request(rid, prompt, [(out, ApiCall(ApiType.MATH, call_s, 4)), (out, None)], arrival_s)


def test_stock_vllm_recomputes_only_what_the_cache_lost() -> None:
    """One request alone, a prompt of 4 blocks: stock vLLM ends it at its call; with the prefix
    cache its return computes only the 8 tokens it generated and the 4 returned (its 4 full blocks
    come back), without the cache the whole context (4 blocks + 12 tokens)."""
    profile = load_profile("gptj-6b-a100")
    block = profile.block_tokens
    prefills = {}
    for cached in (True, False):
        policy = make_policy("vllm", profile.cost, prefix_cache=cached)
        trace = Recorder()
        Simulator([_one_call_request("a", 0.0, prompt=4 * block)], profile, policy, trace=trace).run()
        prefills[cached] = [e["prefill_tokens"] for e in trace.events if e["event"] == "admit"]
    assert prefills[False] == [4 * block, 4 * block + 12]
    assert prefills[True] == [4 * block, 12]


def test_vllm_v0_never_caches() -> None:
    cost = load_profile("gptj-6b-a100").cost
    assert not make_policy("vllm-v0", cost, prefix_cache=True).prefix_cache
    assert not make_policy("infercept-code", cost, prefix_cache=True).prefix_cache
    assert make_policy("vllm", cost, prefix_cache=True).prefix_cache


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_every_policy_conserves_blocks_with_the_prefix_cache(policy: str) -> None:
    """Memory binds (a small KV cache): every block is in use by a live request or in the free
    queue, after every step, and every request finishes."""
    profile = load_profile("gptj-6b-a100")
    profile = scale_kv_capacity(profile, 0.05)
    templates = [t for t in load_trace("agent") if t.final_context_tokens + 1 <= profile.device_blocks * profile.block_tokens]
    requests = poisson_arrivals(templates, 0.5, 120, 3)
    sim = make_simulator(requests, profile, make_policy(policy, profile.cost, prefix_cache=True),
                         on_step=lambda s: s.check_invariants())
    result = sim.run()
    assert len(result.records) == len(requests)
    assert sim.device.used == 0 and sim.host.used == 0


def test_the_cache_changes_a_loaded_run_and_the_record_says_so() -> None:
    on = run_one(RunSpec(policy="vllm", qps=5, duration_s=120))
    off = run_one(RunSpec(policy="vllm", qps=5, duration_s=120, prefix_cache=False))
    v0 = run_one(RunSpec(policy="vllm-v0", qps=5, duration_s=120))
    assert (on["prefix_cache"], off["prefix_cache"], v0["prefix_cache"]) == (True, False, False)
    assert on["e2e_mean_s"] < off["e2e_mean_s"]
    assert v0["e2e_mean_s"] == off["e2e_mean_s"]


def test_a_hit_leaves_the_last_token_to_compute() -> None:
    """A request whose whole 4-block context is cached takes back 3 blocks: the last block is
    computed again for the last token's logits (vLLM caps a hit at the context less one token)."""
    profile = load_profile("gptj-6b-a100")
    block = profile.block_tokens
    sim = Simulator([], profile, make_policy("vllm", profile.cost, prefix_cache=True))
    request = build_request("x", 4 * block, [(1, None)])
    from marsched.policy.progress import RequestProgress
    from marsched.sim.request import SimRequest
    held = SimRequest(RequestProgress(request, order_s=0.0))
    sim.device.allocate(4)
    sim.device.release(4, "x", 4)
    assert sim._prefix_hit(held) == 3
    held.progress.context_tokens += 1
    assert sim._prefix_hit(held) == 4


def test_the_free_queue_refuses_impossible_moves_and_keeps_one_copy_of_a_prefix() -> None:
    queue = FreeBlockQueue(0)
    with pytest.raises(ValueError, match="free queue: cannot take back 2 blocks with 3 full"):
        queue.release(None, 2, 3)
    with pytest.raises(ValueError, match="cannot take back -1 blocks with 0 full"):
        queue.release(None, -1)
    with pytest.raises(RuntimeError, match="free queue: cannot hand out 5 blocks with 0 free"):
        queue.allocate(5)
    queue.release("a", 2)  # blocks that are not full keep no content
    assert queue.cached("a") == 0 and queue.free == 2
    queue.release("a", 2, 2)
    queue.release("a", 3, 3)  # the same request's prefix again: the older copy is stale
    assert queue.cached("a") == 3 and queue.cached_blocks == 3 and queue.free == 7
    queue.check()
    pool = CachingBlockPool("device", 4)
    pool.allocate(2)
    pool.release(2, "b")
    assert pool.name == "device" and pool.queue.cached("b") == 0 and pool.free == 4


def _negative_dead_run(queue: FreeBlockQueue) -> None:
    """A run with -1 dead blocks and one more cached: every total still adds up."""
    run = next(iter(queue._runs.values()))
    run.dead, run.cached = -1, run.cached + 1
    queue.cached_blocks += 1


@pytest.mark.parametrize("corrupt, message", [
    (lambda q: setattr(q, "free", q.free + 1), "blocks in runs"),
    (lambda q: setattr(q, "cached_blocks", q.cached_blocks + 1), "cached"),
    (_negative_dead_run, "blocks in runs"),
    (lambda q: q._run_of.__setitem__("ghost", 99), "the owners' runs do not match the index"),
])
def test_the_free_queues_check_finds_a_queue_that_does_not_add_up(corrupt, message) -> None:
    queue = FreeBlockQueue(2)
    queue.allocate(2)
    queue.release("a", 2, 2)
    queue.check()
    corrupt(queue)
    with pytest.raises(AssertionError, match=message):
        queue.check()


def test_the_host_tier_evicts_the_least_recently_stored_tail_first() -> None:
    tier = HostPrefixTier(10)
    tier.store("a", 4)
    tier.store("b", 4)
    tier.store("c", 4)  # 2 over: a's last 2 blocks go
    assert (tier.stored("a"), tier.stored("b"), tier.stored("c"), tier.used) == (2, 4, 4, 10)
    tier.store("a", 1)  # stored again: as many as it had, most recent now
    assert (tier.stored("a"), tier.used) == (2, 10)
    tier.store("d", 5)  # 5 over: b whole, then 1 of c
    assert (tier.stored("b"), tier.stored("c"), tier.stored("a"), tier.stored("d"), tier.used) == (0, 3, 2, 5, 10)
    tier.retire("d")  # ended: its blocks stay until evicted
    assert (tier.stored("d"), tier.used) == (0, 10)
    tier.truncate("c", 1)
    assert (tier.stored("c"), tier.used) == (1, 8)
    tier.store("e", 20)  # no more than the tier holds
    assert (tier.stored("e"), tier.stored("a"), tier.stored("c"), tier.used) == (10, 0, 0, 10)


def test_a_compacted_context_takes_back_only_the_prefix_it_kept() -> None:
    """Stock vLLM ends a 4-block prompt at its call; the client keeps 2 blocks and adds 2 blocks
    and 12 tokens: the return takes back 2 blocks, not the 4 cached ones it no longer starts with."""
    profile = load_profile("gptj-6b-a100")
    block = profile.block_tokens
    call = ApiCall(ApiType.TOOL, 5.0, 2 * block + 12, kept_tokens=2 * block)
    request = build_request("a", 4 * block, [(8, call), (8, None)], 0.0)
    trace = Recorder()
    Simulator([request], profile, make_policy("vllm", profile.cost, prefix_cache=True), trace=trace).run()
    assert [e["prefill_tokens"] for e in trace.events if e["event"] == "admit"] == [4 * block, 2 * block + 12]


def test_a_compaction_cuts_the_cached_copies_on_the_device_and_the_host() -> None:
    profile = load_profile("gptj-6b-a100")
    block = profile.block_tokens
    sim = Simulator([], profile, make_policy("vllm-offload", profile.cost, prefix_cache=True))
    sim.device.allocate(4)
    sim.device.release(4, "x", 4)
    sim.host_tier.store("x", 4)
    sim._forget_past("x", 2 * block + 5)
    assert (sim.device.queue.cached("x"), sim.host_tier.stored("x")) == (2, 2)


def test_a_host_hit_loads_what_the_device_lost_over_the_link_before_computing() -> None:
    """x's first block survived on the device and all 5 on the host: with exactly 5 blocks free it
    takes the first back and loads the other 4 over the link."""
    from marsched.policy.progress import RequestProgress
    from marsched.sim.request import Phase, SimRequest

    profile = load_profile("gptj-6b-a100")
    block = profile.block_tokens
    sim = Simulator([], profile, make_policy("vllm-offload", profile.cost, prefix_cache=True))
    device = sim.device
    device.allocate(device.capacity)
    device.release(5, "x", 5)
    device.allocate(4)  # x's last 4 blocks are evicted
    device.release(4)
    sim.host_tier.store("x", 5)
    assert (device.queue.cached("x"), device.free) == (1, 5)
    held = SimRequest(RequestProgress(build_request("x", 5 * block + 1, [(1, None)]), order_s=0.0))
    assert sim._start_prefix_load(held, 1)
    assert (device.free, held.device_blocks, held.phase) == (0, 5, Phase.SWAPPING_IN)
    assert (held.transfer.tokens_left, held.transfer.blocks) == (4 * block, 4)
    again = SimRequest(RequestProgress(build_request("x", 5 * block + 1, [(1, None)]), order_s=0.0))
    assert not sim._start_prefix_load(again, 0)  # no room: it waits


def test_the_invariants_catch_a_free_queue_that_drifts_from_its_pool() -> None:
    """A block taken from the pool for a live request but never from the prefix cache's free
    queue: the accounting of held blocks agrees, the free queue does not."""
    profile = load_profile("gptj-6b-a100")
    requests = poisson_arrivals(load_trace("agent"), 0.5, 20, 3)[:2]
    corrupted = []

    def corrupt_once(s):
        s.check_invariants()  # consistent until corrupted
        if not corrupted and s.live:
            corrupted.append(True)
            next(iter(s.live.values())).device_blocks += 1
            s.device.used += 1
            s.check_invariants()

    sim = make_simulator(requests, profile, make_policy("vllm", profile.cost, prefix_cache=True), on_step=corrupt_once)
    assert sim.device.queue is not None
    with pytest.raises(AssertionError, match=r"^free queue holds \d+ blocks, the pool has \d+ free$"):
        sim.run()


def _swapped(sim: Simulator, rid: str, computed_tokens: int):
    """A request back from a swapped call: its computed tokens in host blocks, none on the device."""
    from marsched.policy.progress import RequestProgress
    from marsched.sim.memory import blocks_for
    from marsched.sim.request import Phase, SimRequest

    held = SimRequest(RequestProgress(build_request(rid, computed_tokens + 4, [(1, None)]), order_s=0.0))
    held.progress.computed_tokens = computed_tokens
    held.host_blocks = blocks_for(computed_tokens, sim.block_tokens)
    sim.host.allocate(held.host_blocks)
    held.phase = Phase.SWAPPED
    sim.live[rid] = held
    return held


def test_a_swap_in_copies_only_what_the_device_cache_lost() -> None:
    """A swap-out frees the device blocks with their content, as vLLM frees them: x swapped 4 full
    blocks and 5 tokens out. With all 4 still cached it copies back only its last, partial block;
    with the last 2 evicted, 3 blocks. z waits while its cached blocks are all that is free. y,
    whose 3 blocks were all full and all cached, copies nothing and runs at once."""
    from marsched.sim.request import Phase

    profile = load_profile("gptj-6b-a100")
    block = profile.block_tokens
    for evicted in (0, 2):
        sim = Simulator([], profile, make_policy("swap", profile.cost, prefix_cache=True))
        device = sim.device
        device.allocate(device.capacity)
        device.release(5, "x", 4)  # the partial block has no content to keep: it goes to the head
        device.allocate(1 + evicted)
        device.release(1 + evicted)
        x = _swapped(sim, "x", 4 * block + 5)
        assert device.queue.cached("x") == 4 - evicted
        assert sim._start_swap_in(x)
        assert (x.device_blocks, x.phase, x.host_blocks) == (5, Phase.SWAPPING_IN, 5)
        assert (x.transfer.blocks, x.transfer.tokens_left) == (1 + evicted, (evicted * block) + 5)
        assert device.free == 0 and device.queue.cached("x") == 0

    sim = Simulator([], profile, make_policy("swap", profile.cost, prefix_cache=True))
    sim.device.allocate(sim.device.capacity)
    sim.device.release(3, "z", 3)
    z = _swapped(sim, "z", 4 * block)
    assert not sim._start_swap_in(z)  # 4 blocks to hold, 3 free (its own cached ones): it waits
    assert (z.device_blocks, sim.device.queue.cached("z")) == (0, 3)

    sim = Simulator([], profile, make_policy("swap", profile.cost, prefix_cache=True))
    sim.device.allocate(3)
    sim.device.release(3, "y", 3)
    y = _swapped(sim, "y", 3 * block)
    assert sim._start_swap_in(y)
    assert (y.device_blocks, y.host_blocks, y.transfer, y.phase) == (3, 0, None, Phase.RUNNING)
    assert y in sim.running and sim.host.used == 0 and len(sim.link_in) == 0
    sim.check_invariants()


def test_a_swapped_call_comes_back_from_the_device_cache_when_memory_is_free() -> None:
    """One request alone, Swap at its call: with the prefix cache its full blocks are still on the
    device when the call returns, so the swap-in copies only the partial last block and the
    request ends sooner; without it the whole context comes back over the link."""
    profile = load_profile("gptj-6b-a100")
    block = profile.block_tokens
    copied, e2e = {}, {}
    for cached in (True, False):
        trace = Recorder()
        result = Simulator([_one_call_request("a", 0.0, prompt=4 * block, out=8)], profile,
                           make_policy("swap", profile.cost, prefix_cache=cached), trace=trace).run()
        copied[cached] = [e["blocks"] for e in trace.events if e["event"] == "swap_in"]
        e2e[cached] = result.records[0].e2e_s
    assert copied == {True: [1], False: [5]}
    assert e2e[True] < e2e[False]


def test_a_swap_in_with_nothing_to_copy_runs_on_an_otherwise_idle_engine() -> None:
    """A prompt of exactly 4 blocks and a call after one token (whose KV is not computed yet): all
    its blocks are full, so the swap-in after the call copies nothing. Alone on the engine, it must
    still run on (no transfer, call or arrival is left to wake the engine)."""
    profile = load_profile("gptj-6b-a100")
    block = profile.block_tokens
    request = build_request("a", 4 * block, [(1, ApiCall(ApiType.MATH, 5.0, 4)), (8, None)], 0.0)
    trace = Recorder()
    result = Simulator([request], profile, make_policy("swap", profile.cost, prefix_cache=True), trace=trace).run()
    assert [e["blocks"] for e in trace.events if e["event"] == "swap_in"] == [0]
    assert len(result.records) == 1

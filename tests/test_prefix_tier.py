"""The host prefix tier: its LRU store, its connector without an engine, and stock vLLM with it.

The engine test runs stock vLLM (its scheduler and policy) twice on the tiny model with a
device KV cache too small to keep a conversation's prefix: without the tier and with it. The
follow-up turn, whose prompt extends the first turn's prompt and reply, must find its prefix in
the host tier (fewer tokens computed) and reply with exactly the tokens it replies without it.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from marsched.vllm.kv_prefix_store import PrefixStore

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                reason="no CUDA device on this machine"))]

# --- the store -------------------------------------------------------------------------------


def test_store_evicts_the_least_recently_used_first() -> None:
    store = PrefixStore(3)
    assert [store.put(k) for k in "abc"] == [(True, [])] * 3
    store.touch(["a"])
    assert store.put("d") == (True, ["b"])
    assert store.lru_order() == ["c", "a", "d"]
    assert store.put("a") == (False, []) and store.lru_order() == ["c", "d", "a"]  # held: only touched
    assert store.put("e") == (True, ["c"]) and len(store) == 3


def test_store_matches_consecutively_from_the_start() -> None:
    store = PrefixStore(10)
    for key in ("h0", "h1", "h3"):
        store.put(key)
    hashes = ["h0", "h1", "h2", "h3"]
    assert store.match(hashes, 0, 4) == 2  # h2 is missing: h3 cannot be used without it
    assert store.match(hashes, 1, 4) == 1
    assert store.match(hashes, 0, 1) == 1  # bounded by stop
    assert store.match(hashes, 2, 4) == 0 and store.match(hashes, 3, 2) == 0
    order = store.lru_order()
    store.match(hashes, 0, 4)
    assert store.lru_order() == order  # a lookup is not a use


def test_store_without_capacity_holds_nothing_and_refuses_bad_sizes() -> None:
    store = PrefixStore(0)
    assert store.put("a") == (False, []) and "a" not in store
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(ValueError, match="capacity"):
            PrefixStore(bad)


# --- the connector, scheduler and worker side, no engine -------------------------------------

BLOCK, BLOCKS, HEADS, HEAD = 4, 12, 2, 8


def tier(role: str, extra: dict | None = None, caches: dict | None = None):
    pytest.importorskip("vllm")
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from marsched.vllm.prefix_tier import HostPrefixTierConnector

    spec = SimpleNamespace(page_size_bytes=HEADS * BLOCK * 2 * HEAD * 4)
    config = SimpleNamespace(cache_config=SimpleNamespace(block_size=BLOCK),
                             kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra or {}))
    kv_config = SimpleNamespace(num_blocks=BLOCKS, kv_cache_groups=[SimpleNamespace(
        kv_cache_spec=spec, layer_names=list(caches or ["layer0", "layer1"]))])
    made = HostPrefixTierConnector(config, getattr(KVConnectorRole, role), kv_config)
    if caches is not None:
        made.register_kv_caches(caches)
    return made


def request(rid: str, hashes: list[bytes], tokens: int, computed: int | None = None, prompt: int | None = None):
    return SimpleNamespace(request_id=rid, block_hashes=hashes, num_tokens=tokens,
                           num_prompt_tokens=tokens if prompt is None else prompt,
                           num_computed_tokens=tokens - 1 if computed is None else computed, num_in_flight_tokens=0)


def step(worker, meta) -> set[str]:
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    worker.wait_for_save()
    done, _ = worker.get_finished(set())
    worker.clear_connector_metadata()
    return done or set()


def saved_when_landed(worker, meta, timeout_s: float = 10.0) -> set[str]:
    """The step's finished saves; on CUDA they are reported once their copies have landed."""
    import time

    done, deadline = step(worker, meta), time.monotonic() + timeout_s
    while not done and time.monotonic() < deadline:
        time.sleep(0.01)
        done = worker.get_finished(set())[0] or set()
    return done


def allocated(ids: list[int]):
    return SimpleNamespace(get_block_ids=lambda: (ids,))


def test_capacity_comes_from_one_key_in_tokens_blocks_or_bytes() -> None:
    from marsched.vllm.prefix_tier import DEFAULT_HOST_TOKENS

    assert tier("SCHEDULER").store.capacity == DEFAULT_HOST_TOKENS // BLOCK
    assert tier("SCHEDULER", {"host_tokens": 10}).store.capacity == 2
    assert tier("SCHEDULER", {"host_blocks": 5}).store.capacity == 5
    assert tier("SCHEDULER", {"host_bytes": 3 * 2 * HEADS * BLOCK * 2 * HEAD * 4}).store.capacity == 3  # 2 layers
    with pytest.raises(ValueError, match="give one of"):
        tier("SCHEDULER", {"host_tokens": 8, "host_blocks": 2})
    with pytest.raises(ValueError, match="host_blocks"):
        tier("SCHEDULER", {"host_blocks": -1})
    with pytest.raises(ValueError, match="offload_prompt_only"):
        tier("SCHEDULER", {"offload_prompt_only": "no"})


def test_only_the_prompts_blocks_are_saved_unless_told_otherwise() -> None:
    hashes = [b"p0", b"p1", b"r2", b"r3"]  # a 2.5-block prompt and its reply
    prompt_only = tier("SCHEDULER")
    prompt_only.request_finished(request("a", hashes, 4 * BLOCK + 1, prompt=2 * BLOCK + 2), [1, 2, 3, 4])
    assert [key for key, _ in prompt_only.build_connector_meta(None).saves[0][1]] == [b"p1".hex(), b"p0".hex()]
    everything = tier("SCHEDULER", {"offload_prompt_only": False})
    everything.request_finished(request("a", hashes, 4 * BLOCK + 1, prompt=2 * BLOCK + 2), [1, 2, 3, 4])
    assert len(everything.build_connector_meta(None).saves[0][1]) == 4


@pytest.mark.parametrize("device", DEVICES)
def test_a_finished_request_is_saved_and_a_follow_up_loads_its_prefix_into_its_own_blocks(device) -> None:
    from test_kv_copy import caches_for

    sched = tier("SCHEDULER", {"host_blocks": 8})
    caches, layouts = caches_for("vllm-view-LBHNC", device, layers=2)
    worker = tier("WORKER", caches=caches)
    hashes = [b"a0", b"a1", b"a2"]
    first = request("a", hashes, tokens=3 * BLOCK + 2)
    assert sched.get_num_new_matched_tokens(first, 0) == (0, False)
    sched.update_state_after_alloc(first, allocated([5, 6, 7, 8]), 0)
    assert sched.request_finished(first, [5, 6, 7, 8]) == (True, None)  # freed when the copy is done
    saved = {n: layouts[n].blocks_view(kv)[[5, 6, 7]].clone() for n, kv in caches.items()}
    meta = sched.build_connector_meta(None)
    assert meta.saves == [("a", [(b"a2".hex(), 7), (b"a1".hex(), 6), (b"a0".hex(), 5)])]
    assert saved_when_landed(worker, meta) == {"a"} and worker.host_bytes > 0
    for kv in caches.values():
        kv.zero_()

    # The follow-up's device hit is its first block; the tier has the next two, and it keeps
    # the prompt's last token to compute.
    follow = request("b", hashes + [b"b3"], tokens=4 * BLOCK + 1, computed=0)
    assert sched.get_num_new_matched_tokens(follow, BLOCK) == (2 * BLOCK, False)
    sched.update_state_after_alloc(follow, allocated([1, 2, 3, 4, 9]), 2 * BLOCK)
    meta = sched.build_connector_meta(None)
    assert meta.loads == [(b"a1".hex(), 2), (b"a2".hex(), 3)] and not meta.saves
    step(worker, meta)
    if device == "cuda":
        torch.cuda.synchronize()  # the test reads the blocks on the host; the forward would wait on the device
    for name, kv in caches.items():
        view = layouts[name].blocks_view(kv)
        assert torch.equal(view[[2, 3]], saved[name][[1, 2]])
        assert not view[[1, 4]].any()  # nothing else written
    assert (sched.counts.hits, sched.counts.loaded_blocks, sched.counts.loaded_tokens) == (1, 2, 2 * BLOCK)
    assert sched.counts.saved_blocks == 3 and "1 hits" in sched.summary()

    # The whole prompt held: all but its last token's block is loaded.
    exact = request("c", hashes, tokens=3 * BLOCK, computed=0)
    assert sched.get_num_new_matched_tokens(exact, 0) == (2 * BLOCK, False)


def test_evictions_keep_the_head_and_a_block_evicted_before_it_is_sent_is_not_sent() -> None:
    sched = tier("SCHEDULER", {"host_blocks": 2})
    assert sched.request_finished(request("a", [b"a0", b"a1", b"a2"], 3 * BLOCK + 1), [1, 2, 3]) == (True, None)
    meta = sched.build_connector_meta(None)
    # Tail first, so the third put evicts the tail: only the head two go out, nothing to forget.
    assert meta.saves == [("a", [(b"a1".hex(), 2), (b"a0".hex(), 1)])] and meta.evictions == []
    assert sched.counts.evicted_blocks == 1 and sched.counts.saved_blocks == 2

    # A later request pushes them out: the worker is told to forget what it holds.
    sched.request_finished(request("b", [b"b0", b"b1"], 2 * BLOCK + 1), [4, 5])
    # A third finishes before the next step and evicts one of b's unsent blocks: never sent.
    sched.request_finished(request("c", [b"c0"], BLOCK + 1), [6])
    meta = sched.build_connector_meta(None)
    assert sorted(meta.evictions) == sorted([b"a0".hex(), b"a1".hex()])
    assert dict(meta.saves) == {"b": [(b"b0".hex(), 4)], "c": [(b"c0".hex(), 6)]}
    assert sched.store.lru_order() == [b"b0", b"c0"] and not sched.has_pending_push_work()

    # Evicted but not yet forgotten by the worker, then saved again: the worker keeps its copy.
    sched.request_finished(request("d", [b"d0"], BLOCK + 1), [7])  # evicts b0
    sched.request_finished(request("e", [b"b0"], BLOCK + 1), [8])  # b0 again, evicts c0
    meta = sched.build_connector_meta(None)
    assert meta.evictions == [b"c0".hex()] and dict(meta.saves) == {"d": [(b"d0".hex(), 7)]}


def test_a_request_with_no_full_block_written_is_freed_at_once() -> None:
    sched = tier("SCHEDULER")
    assert sched.request_finished(request("a", [b"a0"], BLOCK + 1, computed=BLOCK - 1), [1]) == (False, None)
    assert sched.request_finished(request("b", [], 3, computed=0), []) == (False, None)
    assert not sched.has_pending_push_work()


# --- stock vLLM with the tier ----------------------------------------------------------------

ENGINE_BLOCKS = 10  # 9 usable blocks of 32 tokens (one is vLLM's null block)


def stock_engine(model: str, host_tokens: int | None):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    transfer = None
    if host_tokens is not None:
        transfer = KVTransferConfig(kv_connector="HostPrefixTierConnector", kv_role="kv_both",
                                    kv_connector_module_path="marsched.vllm.prefix_tier",
                                    kv_connector_extra_config={"host_tokens": host_tokens})
    return LLM(model=model, dtype="float32", enforce_eager=True, block_size=32, max_model_len=256,
               num_gpu_blocks_override=ENGINE_BLOCKS, enable_prefix_caching=True, seed=0,
               kv_transfer_config=transfer, disable_log_stats=True)


def conversation(llm) -> list:
    """A first turn, an unrelated request that takes the whole device cache, then the first turn's
    follow-up (its prompt, its reply, more); their outputs."""
    from vllm import SamplingParams

    rng = random.Random(7)
    greedy = SamplingParams(temperature=0.0, max_tokens=28, ignore_eos=True)
    first = [rng.randrange(4, 500) for _ in range(100)]
    other = [rng.randrange(4, 500) for _ in range(230)]
    (turn,) = llm.generate([{"prompt_token_ids": first}], greedy, use_tqdm=False)
    (filler,) = llm.generate([{"prompt_token_ids": other}], greedy, use_tqdm=False)
    follow = first + list(turn.outputs[0].token_ids) + [rng.randrange(4, 500) for _ in range(40)]
    (follow_up,) = llm.generate([{"prompt_token_ids": follow}], greedy, use_tqdm=False)
    return [turn, filler, follow_up]


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_stock_vllm_loads_a_lost_prefix_from_the_host_tier_and_replies_the_same(tiny_model) -> None:
    import gc

    without = stock_engine(tiny_model, None)
    plain = conversation(without)
    del without
    gc.collect()

    llm = stock_engine(tiny_model, 1 << 16)
    tiered = conversation(llm)
    connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
    counts = connector.counts

    assert [o.outputs[0].token_ids for o in tiered] == [o.outputs[0].token_ids for o in plain]
    # The first turn's prompt, 100 tokens: 3 full blocks (prompt blocks only, the default).
    assert counts.hits == 1 and counts.loaded_blocks >= 2, connector.summary()
    assert plain[2].num_cached_tokens < 3 * 32  # the device lost the prefix
    assert tiered[2].num_cached_tokens == 3 * 32  # device hit + host hit: the 3 blocks
    assert counts.loaded_tokens == tiered[2].num_cached_tokens - plain[2].num_cached_tokens
    assert counts.saved_blocks >= 3 + 7 and counts.evicted_blocks == 0
    del llm
    gc.collect()

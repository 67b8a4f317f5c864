"""MarsScheduler's per-step bookkeeping is incremental, and as exact as re-reading everything.

Each step the scheduler re-reads only the requests vLLM may have changed (running ones,
block holders), not the thousands that may wait, and refreshes waiting keys from each
request's line in τ. This test runs a busy in-process engine (greedy admission into a
small KV cache, so that requests grow, get preempted and queue again, with plans whose
later calls make keys follow the running batch) and checks at every step, inside the
scheduler: every tracked request's view equals vLLM's request; after each refresh, every
waiting key equals a full recomputation and the queue is in that order; and the step
re-read exactly the running and block-holding requests.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from marsched.vllm.metadata import ChunkMeta, PlannedSegment  # noqa: E402
from marsched.workload.model import ApiType  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def llm(tiny_model):
    from vllm import LLM

    config = {"marsched": {"policy": "mars", "admission": "greedy", "starvation": "iterations",
                           "starvation_threshold": 12, "cost": {"swap_tokens_per_s": 1000.0}}}
    engine = LLM(model=tiny_model, dtype="float32", enforce_eager=True, block_size=32, max_model_len=256,
                 num_gpu_blocks_override=10, enable_prefix_caching=False, seed=0,
                 scheduler_cls="marsched.vllm.MarsScheduler", additional_config=config)
    yield engine
    del engine


def _requests(count: int):
    from vllm import SamplingParams

    prompts, params = [], []
    for index in range(count):
        prompt = 30 + (index * 37) % 90
        output = 10 + (index * 23) % 50
        if index % 3 == 0:  # two calls ahead: the second's strategy is chosen against the running batch
            plan = (PlannedSegment(output, ApiType.OTHER, 0.5, 20), PlannedSegment(15, ApiType.OTHER, 2.0, 20),
                    PlannedSegment(10))
        else:
            plan = (PlannedSegment(output),)
        meta = ChunkMeta(0, plan, request_id=f"inc-{index}")
        prompts.append({"prompt_token_ids": [(13 * index + j) % 500 + 4 for j in range(prompt)]})
        params.append(SamplingParams(temperature=0.0, max_tokens=output, ignore_eos=True,
                                     extra_args=meta.to_extra_args()))
    return prompts, params


def test_incremental_sync_and_refresh_equal_a_full_recomputation(llm):
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    policy = sched.mars_policy
    policy.refresh_tolerance = 0.0  # refresh whenever τ moves at all: every refresh is checked
    counts = {"steps": 0, "refreshes": 0, "waiting_seen": 0, "kv_following": 0, "preempted": 0, "syncs": 0}
    schedule, reconsider, order_running = sched.schedule, sched._reconsider_paused, sched._order_running
    sync, preempt = sched._sync, sched._preempt_request

    def counted_sync(tracked, request):
        counts["syncs"] += 1
        sync(tracked, request)

    def step(*args, **kwargs):
        counts["steps"] += 1
        counts["syncs"] = 0
        return schedule(*args, **kwargs)

    def after_sync():  # called right after the step's sync
        active = [r for q in (sched.running, sched.kv_holding_waiting) for r in q if r.request_id in sched._tracked]
        assert counts["syncs"] == len(active)  # only those, not the waiting ones
        counts["waiting_seen"] = max(counts["waiting_seen"], len(sched.waiting))
        for rid, tracked in sched._tracked.items():
            request = sched.requests.get(rid)
            if request is not None:
                progress = tracked.progress
                assert (progress.context_tokens, progress.computed_tokens, progress.generated) == (
                    request.num_tokens, request.num_computed_tokens, request.num_output_tokens), rid
        reconsider()

    def after_refresh(refreshed):  # called right after the step's refresh
        if refreshed:
            counts["refreshes"] += 1
            load = sched._load()
            queue = sched.waiting.queue
            fresh = {}
            for entry in queue._entries.values():
                if not entry.promoted:
                    fresh[entry.progress.request_id] = policy.queue_key(entry.progress, load)
                    assert entry.key == fresh[entry.progress.request_id]
                    counts["kv_following"] += entry.form.follows_running_kv
            keys = [fresh[p.request_id] for p in queue.ordered() if p.request_id in fresh]
            assert keys == sorted(keys)
        order_running(refreshed)

    def counted_preempt(request, *args, **kwargs):
        counts["preempted"] += 1
        preempt(request, *args, **kwargs)

    sched.schedule, sched._reconsider_paused, sched._order_running = step, after_sync, after_refresh
    sched._sync, sched._preempt_request = counted_sync, counted_preempt
    try:
        prompts, params = _requests(24)
        outputs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        for name in ("schedule", "_reconsider_paused", "_order_running", "_sync", "_preempt_request"):
            delattr(sched, name)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [p.max_tokens for p in params]
    assert counts["steps"] > 50 and counts["refreshes"] > 10 and counts["waiting_seen"] > 10
    assert counts["preempted"] > 0 and counts["kv_following"] > 0
    assert not sched._tracked and sched.kv_cache_manager.block_pool.get_num_free_blocks() == 9

"""Refreshing the waiting queue's keys from each request's line in τ (`KeyForm`), not from scratch.

The queue keeps, per request, its key as `a·τ + b` computed at the push, and a refresh
evaluates that line at the new τ; keys that also follow the running batch's KV (a later
call's strategy chosen by waste) are recomputed in full. These tests check that the result
is what a full recomputation gives: the same keys, bit for bit, and the same order.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from marsched.policy import WaitingQueue, make_policy
from marsched.policy.load import EngineLoad
from marsched.policy.progress import RequestProgress
from marsched.policy.ranking import call_area, decode_area, prefill_area
from marsched.workload import ApiCall, ApiType, build_request
from simhelpers import COST, single, two_segment


def three_segment(rid: str, prompt: int, outputs: tuple[int, int, int], api_s: float = 2.0, returned: int = 30):
    return build_request(rid, prompt, [(outputs[0], ApiCall(ApiType.OTHER, api_s, returned)),
                                       (outputs[1], ApiCall(ApiType.OTHER, api_s, returned)),
                                       (outputs[2], None)], 0.0)


def started(policy, request, load, generated: int = 0, computed: int = 0) -> RequestProgress:
    progress = RequestProgress(request, order_s=request.arrival_s)
    policy.start_segment(progress, load)
    progress.generated = generated
    progress.context_tokens += generated
    progress.computed_tokens = computed
    return progress


def reference_area(policy, progress, load) -> float:
    """The memory × time key summed term by term, as `ranking.py`'s docstring states it."""
    area = 0.0
    for segment in policy.outlook(progress, load):
        if segment.prefill_tokens:
            area += prefill_area(segment.context_tokens, segment.prefill_tokens, policy.cost)
        area += decode_area(segment.context_tokens, segment.decode_tokens, load.iteration_s)
        if segment.prediction.has_call and segment.strategy is not None:
            area += call_area(segment.strategy, segment.context_tokens + segment.decode_tokens,
                              segment.prediction.api_duration_s, policy.cost)
    return area


# A slow host link: a discard (whose waste weighs the batch) can be the cheapest, so the
# strategy of a later call, and with it the key, changes with the running KV.
SLOW_LINK = replace(COST, swap_tokens_per_s=1_000)
LOAD = EngineLoad(now_s=0.0, running_kv_tokens=500, iteration_s=0.01, host_free_tokens=1 << 20)
REQUESTS = [single("s", 0.0, 100, 40), two_segment("two", 0.0, 60, 20, 1.5, 10, 30),
            three_segment("three", 80, (20, 15, 10))]


@pytest.mark.parametrize("iteration_s", [1e-4, 0.01, 0.37])
@pytest.mark.parametrize("request_", REQUESTS, ids=lambda r: r.request_id)
def test_key_form_at_any_iteration_time_is_the_memory_time_area(request_, iteration_s):
    policy = make_policy("mars", COST)
    progress = started(policy, request_, LOAD, generated=3, computed=50)
    load = replace(LOAD, iteration_s=iteration_s)
    form = policy.queue_key_form(progress, LOAD)  # the line from one τ...
    assert form.at(iteration_s) == pytest.approx(reference_area(policy, progress, load), rel=1e-12)  # ...at another
    assert form.at(iteration_s) == policy.queue_key(progress, load)  # one formula: equal to the bit


def test_only_keys_whose_later_strategies_weigh_the_batch_follow_the_running_kv():
    mars = make_policy("mars", SLOW_LINK)
    forms = {r.request_id: mars.queue_key_form(started(mars, r, LOAD), LOAD) for r in REQUESTS}
    # A later call that is not the last is given the strategy the waste rule picks, against the batch.
    assert {rid: f.follows_running_kv for rid, f in forms.items()} == {"s": False, "two": False, "three": True}
    three = started(mars, REQUESTS[2], LOAD)
    light, heavy = replace(LOAD, running_kv_tokens=0), replace(LOAD, running_kv_tokens=10**7)
    assert mars.queue_key(three, light) != mars.queue_key(three, heavy)  # so the flag matters
    fixed = make_policy("discard", COST)  # a fixed strategy does not look at the batch
    assert not fixed.queue_key_form(started(fixed, REQUESTS[2], LOAD), LOAD).follows_running_kv
    fcfs = make_policy("vllm", COST).queue_key_form(started(fixed, REQUESTS[0], LOAD), LOAD)
    assert (fcfs.per_iteration_s, fcfs.follows_running_kv) == (0.0, False)


def _random_request(rng: random.Random, index: int):
    prompt = rng.choice([16, 48, 48, 120, 300])
    kind = rng.randrange(3)
    if kind == 0:
        return single(f"r{index}", float(index), prompt, rng.choice([5, 40, 200]))
    if kind == 1:
        return two_segment(f"r{index}", float(index), prompt, rng.randint(1, 60), rng.choice([0.1, 3.0]),
                           rng.randint(0, 40), rng.randint(1, 60))
    outputs = (rng.randint(1, 60), rng.randint(1, 60), rng.randint(1, 60))
    return build_request(f"r{index}", prompt, [(outputs[0], ApiCall(ApiType.OTHER, rng.choice([0.05, 4.0]), 20)),
                                               (outputs[1], ApiCall(ApiType.OTHER, rng.choice([0.05, 4.0]), 20)),
                                               (outputs[2], None)], float(index))


def _assert_full_recomputation(queue: WaitingQueue, policy, load: EngineLoad) -> None:
    fresh = {}
    for entry in queue._entries.values():
        if not entry.promoted:
            fresh[entry.progress.request_id] = policy.queue_key(entry.progress, load)
            assert entry.key == fresh[entry.progress.request_id], entry.progress.request_id
    keys = [fresh[p.request_id] for p in queue.ordered() if p.request_id in fresh]
    assert keys == sorted(keys) and len(keys) == len(fresh)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_order_after_many_steps_equals_a_full_recomputation(seed):
    # A queue that lives through pushes, pops (some put back, some admitted), re-pushes with a
    # changed state (a preempted request that decoded meanwhile), removals, and a τ and a
    # running KV that wander, refreshed every step: after every refresh each key is the one
    # a full recomputation gives at that load, and the queue pops in that order.
    rng = random.Random(seed)
    policy = make_policy("mars", SLOW_LINK, starvation="off", refresh_interval=1)
    queue = WaitingQueue(policy)
    load = LOAD
    out: list[RequestProgress] = []
    index = 0
    refreshed = 0
    for iteration in range(300):
        tau = load.iteration_s * rng.choice([1.0, 1.01, 1.2, 0.8, 1.5, 0.6])
        load = EngineLoad(iteration * tau, rng.choice([0, 200, 5000, 10**6]), min(max(tau, 1e-4), 1.0), 1 << 20)
        for _ in range(rng.randint(0, 3)):
            queue.push(started(policy, _random_request(rng, index), load), load, iteration)
            index += 1
        if out and rng.random() < 0.5:  # a running request is preempted after decoding a little
            progress = out.pop(rng.randrange(len(out)))
            step = rng.randint(1, 10)
            progress.generated += step
            progress.context_tokens += step
            progress.computed_tokens = 0
            queue.push(progress, load, iteration)
            assert queue._entries[progress.request_id].key == policy.queue_key(progress, load)
        if len(queue) and rng.random() < 0.2:
            queue.remove(rng.choice(list(queue._entries)), iteration, load.now_s)
        if queue.refresh(load, iteration):
            refreshed += 1
            _assert_full_recomputation(queue, policy, load)
        popped = queue.pop(iteration, load.now_s)
        if popped is not None:
            if rng.random() < 0.5:
                queue.push_back(popped)
            else:
                out.append(popped)
    assert refreshed > 100 and index > 200


def test_a_request_pushed_again_with_a_new_state_gets_a_new_line():
    policy = make_policy("mars", COST, starvation="off")
    queue = WaitingQueue(policy)
    progress = started(policy, REQUESTS[0], LOAD)
    queue.push(progress, LOAD, 0)
    before = queue._entries["s"].form
    assert queue.pop(0, 0.0) is progress
    progress.generated += 20  # it ran 20 iterations and was preempted
    progress.context_tokens += 20
    queue.push(progress, LOAD, 1)
    after = queue._entries["s"].form
    assert after != before
    later = replace(LOAD, iteration_s=0.05)
    assert queue.refresh(later, 2)
    assert queue._entries["s"].key == policy.queue_key(progress, later)

"""A fault inside MarsScheduler while handling one request ends that request, not the engine.

In-process `LLM` (VLLM_ENABLE_V1_MULTIPROCESSING=0, conftest.py) without the front-end
validator, so bad metadata reaches the scheduler as it would from a client of a plain
`vllm serve --scheduler-cls marsched.vllm.MarsScheduler`; policy faults are injected by
patching the scheduler's policy object for one request. The event trace goes to /dev/full:
the first failed write stops tracing, not the engine.
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest

pytest.importorskip("vllm")

from marsched.policy import EngineLoad  # noqa: E402
from marsched.policy.progress import RequestProgress  # noqa: E402
from marsched.policy.ranking import KeyForm  # noqa: E402
from marsched.vllm.config import MarsConfig  # noqa: E402
from marsched.vllm.metadata import ChunkMeta, PlannedSegment, workload_request  # noqa: E402
from marsched.workload.model import ApiType  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

GOOD = ChunkMeta(0, (PlannedSegment(8),), request_id="good").to_extra_args()


@pytest.fixture(scope="module")
def llm(tiny_model):
    import os

    from vllm import LLM
    from vllm.config import KVTransferConfig

    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    config = {"marsched": {"policy": "mars", "trace_path": "/dev/full"}}
    engine = LLM(model=tiny_model, dtype="float32", enforce_eager=True, block_size=32, max_model_len=256,
                 num_gpu_blocks_override=40, enable_prefix_caching=False, seed=0,
                 scheduler_cls="marsched.vllm.MarsScheduler", additional_config=config,
                 kv_transfer_config=KVTransferConfig(kv_connector="HostSwapConnector", kv_role="kv_both",
                                                     kv_connector_module_path="marsched.vllm.kv_swap"))
    yield engine
    del engine


def scheduler(llm):
    return llm.llm_engine.engine_core.engine_core.scheduler


def params(extra_args, max_tokens=8):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, extra_args=extra_args)


def run(llm, extras):
    prompts = [{"prompt_token_ids": [10 + i, 20 + i, 30 + i, 40 + i]} for i in range(len(extras))]
    return llm.generate(prompts, [params(e) for e in extras], use_tqdm=False)


def assert_idle(sched):
    pool = sched.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
    assert not sched._tracked and not sched.requests and not sched._failed and not sched._error_outputs
    assert sched._swapper.host_tokens_used == 0


@pytest.mark.parametrize("bad", [
    {"marsched": "garbage"},
    {"marsched": 5},
    {"marsched": {"plan": [[8, "no-such-api", 0, 0]]}},
    {"marsched": {"plan": [[8, None, float("nan"), 0]]}},
    {"marsched": {"plan": "abc"}},
    {"marsched": {"strategy": "keep"}},
])
def test_bad_metadata_in_the_scheduler_ends_only_its_request(llm, bad):
    outputs = run(llm, [GOOD, bad, GOOD])
    assert [o.outputs[0].finish_reason for o in outputs] == ["length", "error", "length"]
    assert len(outputs[0].outputs[0].token_ids) == len(outputs[2].outputs[0].token_ids) == 8
    assert_idle(scheduler(llm))
    assert len(run(llm, [GOOD])[0].outputs[0].token_ids) == 8  # the engine serves on


@contextmanager
def faulty(policy, **methods):
    """Replace some of the policy's methods (a slotted dataclass: its class is swapped, then restored)."""
    original = type(policy)
    policy.__class__ = type("Faulty", (original,), {"__slots__": (), **methods})
    try:
        yield
    finally:
        policy.__class__ = original


def test_policy_faults_for_one_request_end_only_that_request(llm):
    sched = scheduler(llm)
    real = type(sched.mars_policy)

    def start_segment(self, progress, load):
        if sched._tracked[progress.request_id].rid == "boom-start":
            raise RuntimeError("injected: start_segment")
        return real.start_segment(self, progress, load)

    def queue_key(self, progress, load):
        if sched._tracked[progress.request_id].rid == "boom-key":
            raise ZeroDivisionError("injected: queue_key")
        return real.queue_key(self, progress, load)

    extras = [GOOD, ChunkMeta(0, (PlannedSegment(8),), request_id="boom-start").to_extra_args(),
              ChunkMeta(0, (PlannedSegment(8),), request_id="boom-key").to_extra_args(), GOOD]
    with faulty(sched.mars_policy, start_segment=start_segment, queue_key=queue_key):
        outputs = run(llm, extras)
    assert [o.outputs[0].finish_reason for o in outputs] == ["length", "error", "error", "length"]
    assert_idle(sched)
    assert len(run(llm, [GOOD])[0].outputs[0].token_ids) == 8


def test_a_failed_trace_write_stops_tracing_not_the_engine(llm):
    sched = scheduler(llm)
    assert not sched.mars_trace.enabled  # /dev/full: the first event failed and tracing stopped
    assert len(run(llm, [GOOD])[0].outputs[0].token_ids) == 8


def test_ranked_queue_refresh_that_fails_for_one_request_rebuilds_from_the_others(monkeypatch):
    from marsched.vllm.ranked_queue import RankedRequestQueue

    class Req:  # what the queue reads of a vLLM request
        def __init__(self, rid):
            self.request_id = rid

    policy = MarsConfig(policy="mars", starvation="off").build_policy(token_budget=2048)
    requests = {rid: Req(rid) for rid in ("a", "b", "x", "c")}
    sizes = {"a": 40, "b": 10, "x": 20, "c": 30}
    plans = {rid: (PlannedSegment(size),) for rid, size in sizes.items()}
    # A refresh recomputes in full only keys that follow the running batch (a later call whose
    # strategy the waste rule picks); the others are re-evaluated from the line found at the push.
    plans["x"] = (PlannedSegment(20, ApiType.OTHER, 1.0, 4), PlannedSegment(4, ApiType.OTHER, 1.0, 4),
                  PlannedSegment(4))
    progress = {rid: RequestProgress(workload_request(rid, 8, plans[rid], 0.0), order_s=0.0) for rid in requests}
    for p in progress.values():
        policy.start_segment(p, EngineLoad(0.0, 0, 0.01, 0))
    faults = []
    load = {"tau": 0.01}
    queue = RankedRequestQueue(policy, lambda r: progress[r.request_id],
                               lambda: EngineLoad(0.0, 0, load["tau"], 0), lambda: 1, lambda: 0.0,
                               on_fault=lambda request, error, where: faults.append(request.request_id))
    for request in requests.values():
        queue.add_request(request)
    real = type(policy)

    def key_form(self, p, engine_load):
        if p.request_id == "x":
            raise ValueError("injected")
        return real.queue_key_form(self, p, engine_load)

    # A refresh recomputes a key that follows the running batch once the batch leaves the range
    # where the key holds (x's later calls keep their strategy at any batch here): as if it had.
    load["tau"] = 0.5
    monkeypatch.setattr(KeyForm, "holds_for", lambda form, running_kv_tokens: not form.follows_running_kv)
    with faulty(policy, queue_key_form=key_form):
        assert queue.refresh(EngineLoad(0.0, 0, 0.5, 0), 5)
    assert faults == ["x"]
    assert [r.request_id for r in queue] == ["b", "c", "a"]  # smallest memory x time first
    assert [queue.pop_request().request_id for _ in range(3)] == ["b", "c", "a"] and not queue


def test_a_request_taken_out_while_held_by_a_peek_keeps_its_starvation_count_to_now():
    """vLLM's admission gate peeks (the head is held out of the queue); a told prediction takes
    the request out and puts it back: its count must run on from its arrival, not from the peek."""
    from marsched.vllm.ranked_queue import RankedRequestQueue

    class Req:
        def __init__(self, rid):
            self.request_id = rid

    policy = MarsConfig(policy="mars", starvation="age", starvation_threshold=100).build_policy(token_budget=2048)
    request = Req("a")
    progress = RequestProgress(workload_request("a", 8, (PlannedSegment(10),), 0.0), order_s=0.0)
    policy.start_segment(progress, EngineLoad(0.0, 0, 0.01, 0))
    clock = {"now": 0.0}
    queue = RankedRequestQueue(policy, lambda r: progress, lambda: EngineLoad(clock["now"], 0, 0.01, 0),
                               lambda: 1, lambda: clock["now"])
    queue.add_request(request)
    clock["now"] = 0.1
    assert queue.peek_request() is request  # held from t=0.1
    clock["now"] = 0.4
    queue.remove_request(request)
    queue.add_request(request)
    clock["now"] = 0.5
    assert queue.starvation_counter("a") == pytest.approx(0.5)

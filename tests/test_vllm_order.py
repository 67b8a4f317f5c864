"""Admission order and starvation prevention inside vLLM, with a constrained KV cache.

In-process `LLM` (VLLM_ENABLE_V1_MULTIPROCESSING=0, set in conftest.py), so the test
reaches the scheduler object. 5 usable blocks of 32 tokens; each request needs 4
(a 100-token prompt plus 20 tokens), so one runs at a time and the rest queue.
All requests are added before the first step; their predicted output lengths come
with the request (`extra_args`, oracle predictor).
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from marsched.metrics.trace import read_trace  # noqa: E402
from marsched.policy import StarvationConfig  # noqa: E402
from marsched.vllm.metadata import ChunkMeta, PlannedSegment  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

PREDICTED = [80, 50, 20, 5]  # in arrival order: the largest first


@pytest.fixture(scope="module")
def llm(tiny_model, tmp_path_factory):
    import os

    from vllm import LLM

    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    trace = tmp_path_factory.mktemp("order") / "events.jsonl"
    config = {"marsched": {"policy": "mars", "starvation_threshold": "off", "trace_path": str(trace)}}
    engine = LLM(model=tiny_model, dtype="float32", enforce_eager=True, block_size=32, max_model_len=160,
                 num_gpu_blocks_override=6, enable_prefix_caching=False, seed=0,
                 scheduler_cls="marsched.vllm.MarsScheduler", additional_config=config)
    engine.trace_file = trace
    yield engine
    del engine


def scheduler(llm):
    return llm.llm_engine.engine_core.engine_core.scheduler


def submit(llm, tag: str) -> list[str]:
    from vllm import SamplingParams

    prompts, params, ids = [], [], []
    for index, predicted in enumerate(PREDICTED):
        rid = f"{tag}-{predicted}"
        meta = ChunkMeta(0, (PlannedSegment(predicted),), request_id=rid)
        prompts.append({"prompt_token_ids": [(7 * index + j) % 500 + 4 for j in range(100)]})
        params.append(SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, extra_args=meta.to_extra_args()))
        ids.append(rid)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 20 for o in outputs)
    return ids


def admissions(llm, tag: str) -> list[dict]:
    return [e for e in read_trace(llm.trace_file) if e["event"] == "admit" and e["rid"].startswith(tag + "-")]


def test_admitted_in_mars_order_not_arrival_order(llm):
    from marsched.vllm import MarsScheduler

    sched = scheduler(llm)
    assert isinstance(sched, MarsScheduler) and sched.mars_policy.name == "mars"
    submit(llm, "order")
    order = [e["rid"] for e in admissions(llm, "order")]
    assert order == ["order-5", "order-20", "order-50", "order-80"]  # predicted memory x time, ascending
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == 5  # all blocks back


def test_starving_request_is_promoted_at_the_threshold(llm):
    sched = scheduler(llm)
    sched.mars_policy.starvation = StarvationConfig(threshold=10, quantum=100_000)
    try:
        submit(llm, "starve")
    finally:
        sched.mars_policy.starvation = StarvationConfig(threshold=None)
    events = read_trace(llm.trace_file)
    arrive_iteration = {e["rid"]: e["iteration"] for e in events if e["event"] == "arrive"}
    promotes = [e for e in events if e["event"] == "promote" and e["rid"].startswith("starve-")]
    # The three that wait behind the first are promoted when their counter reaches 10, in arrival order.
    assert [e["rid"] for e in promotes] == ["starve-80", "starve-50", "starve-20"]
    assert all(e["iteration"] - arrive_iteration[e["rid"]] == 10 and e["counter"] == 10 for e in promotes)
    order = [e["rid"] for e in admissions(llm, "starve")]
    assert order == ["starve-5", "starve-80", "starve-50", "starve-20"]  # the largest no longer waits last


def test_predicted_peak_admission_runs_what_would_outgrow_memory_one_after_the_other(llm):
    # Two 60-token prompts take 2 blocks each (5 are free) but grow to 80 tokens, 3 blocks each:
    # admitted together they would run out of blocks and one would be preempted. MARS's default
    # admission sees the predicted peak (2 x 80 tokens + rounding > 160) and admits one at a time.
    from vllm import SamplingParams

    sched = scheduler(llm)
    prompts, params = [], []
    for index in range(2):
        meta = ChunkMeta(0, (PlannedSegment(20),), request_id=f"peak-{index}")
        prompts.append({"prompt_token_ids": [(11 * index + j) % 500 + 4 for j in range(60)]})
        params.append(SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, extra_args=meta.to_extra_args()))
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 20 for o in outputs)
    events = [e for e in read_trace(llm.trace_file) if e.get("rid", "").startswith("peak-")]
    assert not [e for e in events if e["event"] == "preempt"]
    admits = [e for e in events if e["event"] == "admit"]
    assert len(admits) == 2 and admits[1]["iteration"] - admits[0]["iteration"] >= 20  # after the first is done
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == 5


def test_the_fcfs_wait_estimate_is_told_every_computed_token(llm, monkeypatch):
    from marsched.policy import WaitingQueue

    served: dict[str, int] = {}
    tell = WaitingQueue.served

    def record(self, request_id, tokens):
        served[request_id] = served.get(request_id, 0) + tokens
        tell(self, request_id, tokens)

    monkeypatch.setattr(WaitingQueue, "served", record)
    submit(llm, "served")
    # Each: its 100-token prompt, then 19 decode steps (the 20th token is sampled, never an input).
    assert sorted(served.values()) == [119] * len(PREDICTED)

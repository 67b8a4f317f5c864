"""`marsched bench` and `marsched model` without vLLM: the workload rules, the statistics, the CLI's messages."""

from __future__ import annotations

import json
import math
import os

import pytest
from typer.testing import CliRunner

from marsched.bench.engine_config import (
    BLOCK_TOKENS, KV_SPACE_VAR, enforce_eager, engine_kwargs, kv_blocks_for, restore_environment,
    set_engine_environment,
)
from marsched.bench.model import ModelInfo, ModelShape, _corpus
from marsched.bench.records import Outcome, fit_iteration, iteration_stats, read_jsonl, request_records
from marsched.bench.spec import BenchSpec
from marsched.bench.stream import bench_requests, prompt_token_ids, return_token_ids, scale_request
from marsched.cli import app
from marsched.policy.cost_model import CostModel
from marsched.workload.loader import load_trace
from marsched.workload.model import ApiCall, ApiType, build_request


def req(rid="r", prompt=100, parts=((40, ApiCall(ApiType.MATH, 2.0, 10)), (30, None))):
    return build_request(rid, prompt, list(parts))


# --- prompt ids ---------------------------------------------------------------------------------


def test_prompt_ids_depend_only_on_the_request_id():
    a = prompt_token_ids("q#7", 300, 32_000)
    assert a == prompt_token_ids("q#7", 300, 32_000)  # same id, same ids (no global state)
    assert a[:100] == prompt_token_ids("q#7", 100, 32_000)  # a shorter prompt is a prefix
    assert a != prompt_token_ids("q#8", 300, 32_000)
    assert len(a) == 300 and min(a) >= 4 and max(a) < 32_000  # never a special token
    assert len(set(prompt_token_ids("x", 2000, 512))) > 400  # spread over the vocabulary
    assert return_token_ids("q#7", 0, 20, 512) != return_token_ids("q#7", 1, 20, 512)
    assert return_token_ids("q#7", 0, 20, 512) == return_token_ids("q#7", 0, 20, 512)
    with pytest.raises(ValueError, match="no room"):
        prompt_token_ids("x", 3, 4)


def test_prompt_ids_are_fixed_across_releases():
    # The ids are part of what a recorded bench run means: changing the generator changes the runs.
    assert prompt_token_ids("single-0#0", 5, 32_000) == [26994, 19607, 31366, 31932, 13671]


# --- the token scaling rule -------------------------------------------------------------------------


def test_token_scale_multiplies_and_rounds_with_one_token_at_least():
    r = scale_request(req(prompt=100, parts=((40, ApiCall(ApiType.MATH, 2.0, 10)), (3, None))), 0.1, 10_000)
    assert r.prompt_tokens == 10
    assert [s.output_tokens for s in r.segments] == [4, 1]  # 0.3 rounds to 0, kept at 1
    assert r.segments[0].api.return_tokens == 1
    assert r.segments[1].context_tokens == 10 + 4 + 1  # contexts rebuilt from the scaled counts
    assert r.segments[0].api.duration_s == 2.0  # durations untouched by the token scale
    assert scale_request(req(), 1.0, 10_000) == req()  # scale 1: the request as it is


def test_api_time_scale_scales_durations_only():
    r = scale_request(req(), 1.0, 10_000, api_time_scale=0.25)
    assert r.segments[0].api.duration_s == 0.5 and r.segments[0].api.return_tokens == 10
    assert r.output_tokens == req().output_tokens


def test_a_request_too_long_for_the_engine_is_shrunk_as_a_whole():
    long = req(prompt=3000, parts=((600, ApiCall(ApiType.QA, 1.0, 400)), (1000, None)))  # final context 5000
    r = scale_request(long, 1.0, 1000)
    assert r.final_context_tokens <= 1000
    assert r.final_context_tokens > 900  # not shrunk more than needed
    # The shape is kept: each count about a fifth of the original.
    assert r.prompt_tokens == pytest.approx(600, rel=0.05)
    assert r.segments[0].output_tokens == pytest.approx(120, rel=0.05)
    assert r.segments[1].output_tokens == pytest.approx(200, rel=0.05)
    fits = req(prompt=500, parts=((100, None),))
    assert scale_request(fits, 1.0, 600) == fits  # a request that fits is not touched


def test_a_trailing_calls_return_is_not_in_the_context():
    trailing = build_request("t", 100, [(50, ApiCall(ApiType.TTS, 1.0, 10)), (50, ApiCall(ApiType.TTS, 1.0, 900))])
    assert scale_request(trailing, 1.0, 210) == trailing  # 100 + 50 + 10 + 50: the 900 never enter the cache


def test_segments_that_cannot_fit_are_an_error():
    many = build_request("m", 10, [(5, ApiCall(ApiType.QA, 1.0, 0))] * 9 + [(5, None)])
    with pytest.raises(ValueError, match="do not fit in 8 tokens"):
        scale_request(many, 1.0, 8)


@pytest.mark.parametrize("scale", [0.0, -1.0, math.nan, math.inf])
def test_bad_token_scale(scale):
    with pytest.raises(ValueError, match="--token-scale"):
        scale_request(req(), scale, 1000)


@pytest.mark.filterwarnings("ignore::marsched.workload.errors.TraceWarning")  # the multi-API trace's known negatives
def test_every_bundled_trace_fits_the_small_models_length():
    for name in ("single", "multi", "agent"):
        requests = bench_requests(load_trace(name), 2.0, 30.0, 0, 1.0, 4096, 0.1, max_requests=40)
        assert len(requests) == 40
        assert all(r.final_context_tokens <= 4096 for r in requests)
        assert [r.arrival_s for r in requests] == sorted(r.arrival_s for r in requests)
    again = bench_requests(load_trace("single"), 2.0, 30.0, 0, 1.0, 4096, 0.1, max_requests=40)
    assert again == bench_requests(load_trace("single"), 2.0, 30.0, 0, 1.0, 4096, 0.1, max_requests=40)


# --- engine sizing -------------------------------------------------------------------------------------


def test_kv_blocks_from_gib():
    assert kv_blocks_for(1.0, 2048) == (1 << 30) // (2048 * BLOCK_TOKENS)  # 4096 blocks of the small model
    assert kv_blocks_for(0.01, 512) == 163
    with pytest.raises(ValueError, match="--kv-cache-gb 0.0001: holds 0 block"):
        kv_blocks_for(0.0001, 2048)


def test_max_model_len_is_what_one_request_may_use():
    model = ModelInfo("m", 4, 2, 64, "bfloat16", 4096, 32_000, "m")
    assert model.kv_bytes_per_token == ModelShape().kv_bytes_per_token == 2048
    plan = BenchSpec("m", kv_cache_gb=0.005).engine_plan(model)
    assert plan.num_gpu_blocks == 20 and plan.max_model_len == 19 * BLOCK_TOKENS  # the KV cache binds
    assert plan.kv_space_gib == 1 and plan.dtype == "bfloat16"
    plan = BenchSpec("m", kv_cache_gb=2.0, max_model_len=1000).engine_plan(model)
    assert plan.max_model_len == 1000 and plan.kv_space_gib == 2
    assert BenchSpec("m", kv_cache_gb=2.0).engine_plan(model).max_model_len == 4096  # the model binds
    assert BenchSpec("m", dtype="float32").engine_plan(model).dtype == "float32"


class _Platform:
    def __init__(self, cpu: bool):
        self.cpu = cpu

    def is_cpu(self) -> bool:
        return self.cpu


def test_the_engine_runs_eagerly_on_the_cpu_only():
    model = ModelInfo("m", 4, 2, 64, "bfloat16", 4096, 32_000, "m")
    plan = BenchSpec("m", kv_cache_gb=0.005).engine_plan(model)
    cpu = engine_kwargs(plan, 7, _Platform(cpu=True))
    assert cpu == {"dtype": "bfloat16", "enforce_eager": True, "block_size": BLOCK_TOKENS,
                   "max_model_len": 19 * BLOCK_TOKENS, "seed": 7, "num_gpu_blocks_override": 20}
    assert engine_kwargs(plan, 7, _Platform(cpu=False)) == {**cpu, "enforce_eager": False}  # CUDA graphs on a GPU
    unsized = BenchSpec("m").engine_plan(model)
    assert "num_gpu_blocks_override" not in engine_kwargs(unsized, 0, _Platform(cpu=True))


def test_the_engine_environment_is_set_for_the_start_and_put_back(monkeypatch):
    monkeypatch.delenv("MARSCHED_TEST_STEP_LOG", raising=False)
    monkeypatch.setenv(KV_SPACE_VAR, "7")
    model = ModelInfo("m", 4, 2, 64, "bfloat16", 4096, 32_000, "m")
    saved = set_engine_environment(BenchSpec("m", kv_cache_gb=2.5).engine_plan(model),
                                   {"MARSCHED_TEST_STEP_LOG": "/tmp/steps.jsonl"})
    assert os.environ["MARSCHED_TEST_STEP_LOG"] == "/tmp/steps.jsonl" and os.environ[KV_SPACE_VAR] == "3"
    restore_environment(saved)
    assert "MARSCHED_TEST_STEP_LOG" not in os.environ and os.environ[KV_SPACE_VAR] == "7"
    saved = set_engine_environment(BenchSpec("m").engine_plan(model), {})  # sized by the variable as set
    assert os.environ[KV_SPACE_VAR] == "7"
    restore_environment(saved)


def test_the_engine_knows_its_own_platform():
    pytest.importorskip("vllm")
    from vllm.platforms import current_platform

    assert enforce_eager() == current_platform.is_cpu()


# --- measurements ----------------------------------------------------------------------------------------


def steps(*rows):
    return [{"t": i, "sched_s": 1e-4, "update_s": 5e-5, "step_s": s, "tokens": n, "seqs": q, "prefill_seqs": p,
             "ctx": 100}
            for i, (s, n, q, p) in enumerate(rows)]


def test_iteration_fit_and_statistics():
    rows = steps(*[(0.010 + 1e-5 * n, n, 4, 1 if n > 4 else 0) for n in (4, 4, 4, 100, 500, 1000)], (0.001, 0, 0, 0))
    fit = fit_iteration(rows)
    assert fit["c_s"] == pytest.approx(0.010) and fit["a_s_per_token"] == pytest.approx(1e-5)
    assert fit["r2"] == pytest.approx(1.0) and fit["steps"] == 6  # the idle step is left out
    stats = iteration_stats(rows)
    assert stats["count"] == 6 and stats["idle_steps"] == 1
    assert stats["p50_s"] == pytest.approx(0.01004 + 0.00048) and stats["decode_only_steps"] == 3
    assert stats["schedule_p50_s"] == pytest.approx(1e-4) and stats["update_mean_s"] == pytest.approx(5e-5)
    assert stats["p99_s"] <= max(r["step_s"] for r in rows)
    flat = fit_iteration(steps((0.02, 1, 1, 0), (0.03, 1, 1, 0)))  # one token count: no slope to fit
    assert flat["a_s_per_token"] == 0.0 and flat["c_s"] == pytest.approx(0.025)
    assert math.isnan(fit_iteration([])["c_s"])
    # Noise that makes longer steps faster: no negative cost per token, a constant step time instead.
    falling = fit_iteration(steps((0.03, 10, 1, 1), (0.02, 100, 1, 1), (0.01, 1000, 1, 1)))
    assert falling["a_s_per_token"] == 0.0 and falling["c_s"] == pytest.approx(0.02)


def test_read_jsonl_skips_a_line_cut_by_a_killed_engine(tmp_path):
    path = tmp_path / "steps.jsonl"
    path.write_text('{"a": 1}\n{"a": 2}\n{"a": ')
    assert read_jsonl(path) == [{"a": 1}, {"a": 2}]
    assert read_jsonl(tmp_path / "missing.jsonl") == []


def test_records_take_times_from_the_client_and_the_rest_from_the_trace():
    r = scale_request(req("a#0"), 1.0, 10_000)
    done = Outcome(r, planned_t=100.0, submitted_t=100.01, first_token_t=100.5, finish_t=104.0, api_time_s=2.0,
                   output_tokens=70, api_return_tokens=10, strategies=["preserve"])
    lost = Outcome(scale_request(req("b#1"), 1.0, 10_000), planned_t=101.0, error="boom")
    events = [{"event": "admit", "rid": "a#0", "wait_s": 0.2}, {"event": "preempt", "rid": "a#0"},
              {"event": "admit", "rid": "a#0", "wait_s": 0.7}, {"event": "finish", "rid": "a#0", "strategies": ["swap"]}]
    cost = CostModel(1e-5, 0.01, 2048, 1e9)
    records = request_records([done, lost], events, 99.0, cost)
    assert len(records) == 1
    record = records[0]
    assert (record.arrival_s, record.ttft_s, record.e2e_s) == pytest.approx((1.0, 0.5, 4.0))
    assert record.preemptions == 1 and record.max_wait_s == 0.7 and record.strategies == ("swap",)
    assert record.output_tokens == 70 and record.api_time_s == 2.0 and record.prompt_tokens == 100
    assert record.isolated_e2e_s == pytest.approx(0.01 + 1e-5 * 100 + 39 * (0.01 + 1e-5) + 2.0
                                                  + 0.01 + 1e-5 * 11 + 29 * (0.01 + 1e-5))


def test_the_tokenizer_corpus_is_seeded():
    assert _corpus(3, 50) == _corpus(3, 50) != _corpus(4, 50)


# --- the command line ------------------------------------------------------------------------------------

runner = CliRunner()


def run(*args):
    result = runner.invoke(app, list(args))
    return result.exit_code, result.output


def test_model_refuses_a_non_empty_directory_without_force(tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    code, output = run("model", "--out", str(tmp_path))
    assert code == 2 and "--out" in output and "not empty" in output and "--force" in output
    assert (tmp_path / "keep.txt").read_text() == "mine"


@pytest.mark.parametrize("args,message", [
    (("--layers", "0"), "--layers 0: give an integer >= 1"),
    (("--hidden", "100", "--heads", "8"), "--hidden 100: must be a multiple of --heads (8)"),
    (("--heads", "8", "--kv-heads", "3"), "--heads 8: must be a multiple of --kv-heads (3)"),
    (("--vocab", "100"), "--vocab 100: give an integer >= 512"),
    (("--dtype", "int8"), "--dtype int8: valid: bfloat16, float32"),
])
def test_model_names_the_flag(tmp_path, args, message):
    code, output = run("model", "--out", str(tmp_path / "m"), *args)
    assert code == 2 and message in " ".join(output.split()), output
    assert not (tmp_path / "m").exists()


@pytest.fixture
def model_dir(tmp_path):
    config = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 128,
              "vocab_size": 512, "max_position_embeddings": 1024, "dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


@pytest.mark.parametrize("args,message", [
    (("--policies", "vllm,fifo"), "--policies fifo: unknown policy; valid: vllm, vllm-v0, vllm-offload, infercept"),
    (("--qps", "0"), "--qps '0': give finite numbers > 0"),
    (("--qps", "fast"), "--qps 'fast': give comma-separated numbers"),
    (("--duration", "0"), "--duration 0: give a finite number > 0"),
    (("--token-scale", "0"), "--token-scale 0: give a finite number > 0"),
    (("--api-time-scale", "-1"), "--api-time-scale -1: give a finite number >= 0"),
    (("--kv-cache-gb", "0.00001"), "--kv-cache-gb 1e-05: holds 0 block(s)"),
    (("--max-requests", "0"), "--max-requests 0: give at least 1"),
    (("--predictor", "magic"), "--predictor magic:"),
    (("--api-estimator", "psychic"), "--api-estimator psychic:"),
    (("--trace", "nope.txt"), "--trace nope.txt:"),
    (("--dtype", "int4"), "--dtype int4: valid: auto, bfloat16, float32"),
    (("--seed", "-1"), "--seed -1: give an integer from 0 to 2^32-1"),
    (("--max-model-len", "8"), "--max-model-len 8: give at least 32"),
    (("--policies", "infercept-code"), "--policies infercept-code: runs only in the simulator"),
    (("--profile", "nope.json"), "--profile nope.json: no profile file nope.json"),
    (("--kv-cache-gb", "0"), "--kv-cache-gb 0: give a finite number of GiB > 0"),
])
def test_bench_names_the_flag(model_dir, args, message):
    code, output = run("bench", "--model", model_dir, *args)
    assert code == 2 and message in " ".join(output.split()), output


def test_bench_without_a_model(tmp_path):
    code, output = run("bench", "--model", str(tmp_path / "none"))
    assert code == 2 and "--model" in output and "marsched model --out DIR" in " ".join(output.split())


def test_bench_output_directory_must_exist(model_dir, tmp_path):
    code, output = run("bench", "--model", model_dir, "--json", str(tmp_path / "no" / "out.json"))
    assert code == 2 and "--json" in output and "does not exist" in output


def test_bench_table_keeps_the_policies_in_the_order_given():
    from marsched.bench.commands import _table

    def record(policy, qps):
        iteration = {"p50_s": 0.01, "p99_s": 0.02, "schedule_p50_s": 0.0001}
        return {"policy": policy, "qps": qps, "num_finished": 0, "num_requests": 1, "iteration": iteration}

    table = _table([record("vllm", 2.0), record("mars", 1.0), record("vllm", 1.0), record("infercept", 1.0),
                    record("mars", 2.0)])
    rows = list(zip(table.columns[0]._cells, table.columns[1]._cells))
    assert rows == [("1", "mars"), ("1", "vllm"), ("1", "infercept"), ("2", "vllm"), ("2", "mars")]


@pytest.mark.parametrize("starvation, message", [("nope", "unknown starvation variant"),
                                                 ("fcfs-wait:x", "must be a number"),
                                                 ("age:2", "only fcfs-wait takes a multiple")])
def test_a_bad_starvation_variant_is_named_with_its_flag(starvation, message):
    with pytest.raises(ValueError, match=f"--starvation {starvation}: .*{message}"):
        BenchSpec("model", starvation=starvation).check()
    BenchSpec("model", starvation="fcfs-wait:1.5").check()  # a multiple is fine


def test_the_record_names_the_starvation_multiple():
    from marsched.bench.runner import policy_fields
    from marsched.policy import make_policy
    from simhelpers import COST

    assert policy_fields(make_policy("mars", COST, starvation="fcfs-wait:1.5"))["starvation_fcfs_multiple"] == 1.5
    assert policy_fields(make_policy("mars", COST, starvation="age"))["starvation_fcfs_multiple"] is None

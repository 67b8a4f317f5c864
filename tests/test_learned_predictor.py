"""The learned length predictor: eval metrics, heads, the type-mean fallback, the CLI's errors.

Tests that run the MiniLM encoder or read ShareGPT need the `predict` extra (CI installs it:
`scripts/setup.sh --vllm`); they carry the `predict` marker and skip only where it is missing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from marsched.predict import metrics
from marsched.predict.head import BINS, Head, length_bin, load_head
from marsched.predict.learned import LearnedLength, TypeMeanLength, default_head_dir, head_directory
from marsched.predict.length import parse_length_predictor, prepare_length_predictor
from marsched.workload import ApiCall, ApiType, build_request
from marsched.workload.loader import load_trace

needs_extra = pytest.mark.predict


def _extra_installed() -> bool:
    import importlib.util

    return all(importlib.util.find_spec(m) for m in ("all_minilm_l6_v2", "safetensors"))


def marsched(*args):
    return subprocess.run([sys.executable, "-m", "marsched.cli", *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "COLUMNS": "200"})


# --- metrics on small known inputs -----------------------------------------------------------


def test_bins_are_ten_tokens_and_the_last_is_open():
    assert list(length_bin(np.array([0, 9, 10, 489, 490, 5000]))) == [0, 0, 1, 48, 49, 49]


def test_bin_accuracies():
    true = np.array([5, 15, 25, 600])
    predicted = np.array([9, 26, 45, 495])  # same bin, one off, two off, both in the open bin
    assert metrics.bin_accuracy(predicted, true, 0) == 0.5
    assert metrics.bin_accuracy(predicted, true, 1) == 0.75


def test_mae():
    assert metrics.mean_absolute_error(np.array([10, 20]), np.array([13, 10])) == 6.5


def test_kendall_tau_perfect_reversed_and_tied():
    true = np.array([1.0, 2.0, 3.0, 4.0])
    assert metrics.kendall_tau(true * 10, true) == pytest.approx(1.0)
    assert metrics.kendall_tau(-true, true) == pytest.approx(-1.0)
    assert metrics.kendall_tau(np.ones(4), true) == 0.0  # a constant predictor ranks nothing
    # tau-b with a tie in the predictions: (C - D) / sqrt((n0 - n1)(n0 - n2)) = 5 / sqrt(5 * 6)
    assert metrics.kendall_tau(np.array([1, 1, 2, 3]), true) == pytest.approx(5 / np.sqrt(30))


def test_kendall_tau_agrees_across_chunks():
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 20, 300), rng.integers(0, 20, 300)
    assert metrics.kendall_tau(x, y, chunk=7) == pytest.approx(metrics.kendall_tau(x, y, chunk=1000))


def test_metrics_reject_mismatched_inputs():
    with pytest.raises(ValueError, match="same length"):
        metrics.report(np.array([1.0, 2.0]), np.array([1.0]))
    with pytest.raises(ValueError, match="no examples"):
        metrics.report(np.array([]), np.array([]))


# --- heads --------------------------------------------------------------------------------------


def _head(kind: str) -> Head:
    rng = np.random.default_rng(1)
    outputs = BINS if kind == "bins" else 1
    bins = np.arange(BINS, dtype=np.float32) * 10 + 5 if kind == "bins" else None
    return Head(kind, np.zeros(4, np.float32), np.ones(4, np.float32),
                (rng.normal(size=(4, 8)).astype(np.float32), rng.normal(size=(8, outputs)).astype(np.float32)),
                (np.zeros(8, np.float32), np.zeros(outputs, np.float32)), bins, {"encoder": "embed", "clip": [1, 900]})


@pytest.mark.parametrize("kind", ["bins", "log"])
def test_a_head_round_trips_through_its_file(tmp_path, kind):
    head = _head(kind)
    head.save(tmp_path)
    loaded = load_head(tmp_path)
    x = np.random.default_rng(2).normal(size=(5, 4)).astype(np.float32)
    assert np.allclose(loaded.predict(x), head.predict(x))
    assert loaded.meta["encoder"] == "embed" and loaded.kind == kind
    assert ((loaded.predict(x) >= 1) & (loaded.predict(x) <= 900)).all()


def test_a_bins_head_predicts_its_median_bin():
    head = _head("bins")
    logits = np.full((1, BINS), -50.0)
    logits[0, [2, 3, 40]] = [np.log(0.3), np.log(0.3), np.log(0.4)]  # argmax is bin 40, median is bin 3
    probe = Head("bins", np.zeros(BINS, np.float32), np.ones(BINS, np.float32), (np.eye(BINS, dtype=np.float32),),
                 (np.zeros(BINS, np.float32),), head.bin_lengths, {})
    assert probe.predict(logits.astype(np.float32))[0] == 35


def test_loading_a_missing_or_broken_head_names_the_file(tmp_path):
    with pytest.raises(ValueError, match="no trained head here"):
        load_head(tmp_path)
    (tmp_path / "head.npz").write_bytes(b"not a zip")
    with pytest.raises(ValueError, match="head.npz: not a marsched predictor head"):
        load_head(tmp_path)


def test_the_packaged_head_loads_and_is_small():
    head = load_head(default_head_dir())
    assert os.path.getsize(os.path.join(default_head_dir(), "head.npz")) < 1_000_000
    assert head.meta["encoder"] in ("embed", "transformer")


# --- predictors: the type-mean rule and the fallback -------------------------------------------

CALC = build_request("calc", 100, [(200, ApiCall(ApiType.MATH, 0.0001, 20)), (50, None)])
CALC2 = build_request("calc2", 100, [(100, ApiCall(ApiType.MATH, 0.0001, 20)), (30, None)])


def test_type_mean_is_the_mean_per_kind_of_segment():
    predictor = parse_length_predictor("type-mean")
    prepare_length_predictor(predictor, [CALC, CALC2], None)
    assert predictor.predict(CALC, 0) == 150  # segments ending with a MATH call
    assert predictor.predict(CALC, 1) == 40  # segments ending the request
    tts = build_request("tts", 10, [(5, ApiCall(ApiType.TTS, 1.0, 5)), (5, None)])
    assert predictor.predict(tts, 0) == round((200 + 100 + 50 + 30) / 4)  # an unseen kind: the overall mean


def test_type_mean_before_prepare_is_an_error():
    with pytest.raises(RuntimeError, match="prepare"):
        TypeMeanLength().predict(CALC, 0)


def test_learned_spec_parsing():
    assert head_directory("learned") is None
    assert head_directory("learned:/x/y") == "/x/y"
    with pytest.raises(ValueError, match="DIR is empty"):
        head_directory("learned:")
    with pytest.raises(ValueError, match="no trained head here"):
        parse_length_predictor("learned:/nonexistent/dir")


@needs_extra
def test_learned_predicts_text_records_and_falls_back_on_token_counts():
    if not _extra_installed():
        pytest.skip("the predict extra is not installed")
    templates = load_trace("single")
    predictor = parse_length_predictor("learned")
    assert isinstance(predictor, LearnedLength)
    prepare_length_predictor(predictor, templates, "single")
    assert predictor.learned_share == 195  # the chatbot, TTS and image records of the single-API trace
    fallback = TypeMeanLength()
    fallback.prepare(templates)
    text_ids = set(predictor.table)
    for request in templates:
        for index in range(len(request.segments)):
            predicted = predictor.predict(request, index)
            assert predicted >= 1
            if request.request_id not in text_ids:  # token-count records (math, QA, VE): the rule
                assert predicted == fallback.predict(request, index)
    # arrivals sampled from a template get the template's prediction
    text = next(r for r in templates if r.request_id in text_ids)
    assert predictor.predict(text.arriving_at(3.0, f"{text.request_id}#9"), 0) == predictor.table[text.request_id][0]


@needs_extra
def test_learned_predictions_follow_the_text():
    if not _extra_installed():
        pytest.skip("the predict extra is not installed")
    from marsched.predict.learned import load_model

    model = load_model(None)
    short = model.predict_one("What is 2+2? Answer with one number.", 12)
    long = model.predict_one("Write a detailed 2000-word essay on the history of the Roman Empire, "
                             "with sections on its rise, its emperors, its economy and its fall.", 40)
    assert 1 <= short < long


# --- the CLI --------------------------------------------------------------------------------------


def test_cli_rejects_a_bad_predictor_directory(tmp_path):
    run = marsched("simulate", "--predictor", f"learned:{tmp_path}", "--duration", "5")
    assert run.returncode == 2
    assert "--predictor learned:" in run.stderr and "no trained head here" in run.stderr


def test_cli_eval_without_a_head_names_the_directory(tmp_path):
    run = marsched("predictor", "eval", str(tmp_path))
    assert run.returncode == 2 and "no head.npz here" in run.stderr


def test_cli_train_refuses_to_overwrite_and_bad_options(tmp_path):
    _head("log").save(tmp_path)
    run = marsched("predictor", "train", "--out", str(tmp_path))
    assert run.returncode == 2 and "--force" in run.stderr
    run = marsched("predictor", "train", "--out", str(tmp_path / "new"), "--encoder", "bert")
    assert run.returncode == 2 and "--encoder bert" in run.stderr
    run = marsched("predictor", "train", "--out", str(tmp_path / "new"), "--heads", "bins,magic")
    assert run.returncode == 2 and "--heads" in run.stderr


@needs_extra
def test_cli_simulate_with_learned_and_type_mean(tmp_path):
    if not _extra_installed():
        pytest.skip("the predict extra is not installed")
    for spec in ("learned", "type-mean"):
        out = tmp_path / f"{spec}.json"
        run = marsched("simulate", "--predictor", spec, "--duration", "20", "--qps", "4", "--json", str(out))
        assert run.returncode == 0, run.stderr
        record = json.loads(out.read_text())[0]
        assert record["predictor"].startswith(spec)
        assert record["num_finished"] == record["num_requests"] > 0


# --- the vLLM side, without vLLM: the chunk metadata and the scheduler's predictor ---------------


def test_chunk_metadata_carries_a_front_end_prediction():
    from marsched.vllm.metadata import ChunkMeta, MetadataError, PlannedSegment, parse

    meta = ChunkMeta(1, (PlannedSegment(8), PlannedSegment(4)), predicted=37)
    assert parse(meta.to_dict()).predicted == 37
    assert parse(meta.to_vllm_xargs()["marsched"]).predicted == 37
    assert parse({"plan": [[8, None, 0, 0]]}).predicted is None
    for bad in (0, -3, 2.5, "12", True):
        with pytest.raises(MetadataError, match=r"marsched\.predicted"):
            parse({"predicted": bad})


def test_a_conversation_id_that_its_release_path_could_not_carry_is_refused():
    from marsched.vllm.metadata import MetadataError, parse

    assert parse({"plan": [[8, None, 0, 0]], "conversation": "team:7.a-b"}).conversation == "team:7.a-b"
    for bad in ("a/b", "/", "", "x" * 257, 7):
        with pytest.raises(MetadataError, match=r"marsched\.conversation"):
            parse({"plan": [[8, None, 0, 0]], "conversation": bad})


def test_the_scheduler_reads_learned_lengths_from_the_plan():
    from marsched.predict.learned import FrontEndLength
    from marsched.vllm.config import MarsConfig

    config = MarsConfig(predictor="learned")
    assert config.learned and config.front_end
    length = config.build_policy(token_budget=256).predictor.length
    assert isinstance(length, FrontEndLength) and length.name == "learned"
    assert length.predict(CALC, 0) == 200  # the plan's length, which carries the front end's prediction
    assert not MarsConfig(predictor="oracle").front_end
    assert MarsConfig(predictor="type-mean").front_end  # a trace replay sends type means the same way


def test_bench_sends_trace_predictions_scaled_like_the_lengths():
    from marsched.bench.real import BenchSpec, bench_requests, trace_predictions

    templates = load_trace("single")
    stream = bench_requests(templates, 2.0, 20.0, 0, 0.5, 100_000, 1.0)
    assert trace_predictions(BenchSpec("model", predictor="oracle"), templates, stream) == {}
    predicted = trace_predictions(BenchSpec("model", predictor="type-mean", token_scale=0.5), templates, stream)
    rule = TypeMeanLength()
    rule.prepare(templates)
    for request in stream:
        assert predicted[request.request_id] == [max(1, round(rule.predict(request, i) * 0.5))
                                                 for i in range(len(request.segments))]

"""`learned-online`: a head's estimate calibrated online by the replies served (`marsched.predict.calibrated`),
and the held-out-family evaluation's replay and metrics (`marsched.experiments.predictor_calibration`)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from marsched.experiments.predictor_calibration import compare, replay, table_of, true_lengths
from marsched.predict.calibrated import MAX_FACTOR, PRIOR_WEIGHT, CalibratedLength
from marsched.predict.online import OnlineLength
from marsched.predict.segment import SegmentPredictor
from marsched.predict.online import PastMeanApi
from marsched.workload import ApiCall, ApiType, build_request
from marsched.workload.past import RequestPast

needs_extra = pytest.mark.predict


def _extra_installed() -> bool:
    import importlib.util

    return all(importlib.util.find_spec(m) for m in ("all_minilm_l6_v2", "safetensors"))


def _call() -> ApiCall:
    return ApiCall(ApiType.TOOL, 1.0, 10)


def _request(rid: str, lengths: list[int], task_class: str = "chat"):
    parts = [(n, _call()) for n in lengths[:-1]] + [(lengths[-1], None)]
    request = build_request(rid, 100, parts)
    object.__setattr__(request, "task_class", task_class)  # frozen: the class a prompt shows
    return request


def _serve(predictor: CalibratedLength, request) -> list[int]:
    """Each segment predicted from its past, then observed, as the policy does."""
    predicted = []
    for index, segment in enumerate(request.segments):
        past = RequestPast.of(request, index)
        predicted.append(predictor.predict_past(past))
        predictor.observe_output(past, segment.output_tokens)
    return predicted


# --- the calibration ----------------------------------------------------------------------------


def test_without_observations_it_is_the_head():
    predictor = CalibratedLength(table={"a": [120, 40]})
    assert predictor.predict(_request("a", [50, 60]), 0) == 120
    assert predictor.factor(RequestPast.of(_request("a", [50, 60]), 0)) == 1.0


def test_the_class_factor_moves_toward_observed_over_estimated():
    table = {f"r{i}": [100] for i in range(40)}
    predictor = CalibratedLength(table=table)
    first = [_serve(predictor, _request(f"r{i}", [300]))[0] for i in range(40)]
    # each prediction at least as close to 300 as the one before, never past it
    assert first[0] == 100
    assert all(a <= b <= 300 for a, b in zip(first, first[1:]))
    assert first[1] > 150 and first[-1] > 290
    # the geometric mean, shrunk toward the position's (over every class), shrunk toward 1: each
    # prior counted as PRIOR_WEIGHT observations
    n, log3 = 39, math.log(3)
    position = n * log3 / (n + PRIOR_WEIGHT)
    assert first[-1] == round(100 * math.exp((n * log3 + PRIOR_WEIGHT * position) / (n + PRIOR_WEIGHT)))
    # and downward for a head that is too long
    low = CalibratedLength(table=table)
    assert [_serve(low, _request(f"r{i}", [10]))[0] for i in range(5)][-1] < 50


def test_the_request_own_earlier_segments_pull_its_factor():
    table = {"long": [100, 100, 100, 100], "plain": [100, 100, 100, 100]}
    predictor = CalibratedLength(table=table)
    _serve(predictor, _request("plain", [100, 100, 100, 100]))
    own = _serve(predictor, _request("long", [400, 400, 400, 400]))
    assert own[0] == 100  # nothing of its own yet, the class says 1
    assert own[1] < own[2] < own[3] < 400  # each of its replies 4x its estimate: toward 4x
    assert own[3] > 200


def test_the_factor_is_bounded_and_one_outlier_moves_it_little():
    table = {f"r{i}": [10] for i in range(50)}
    predictor = CalibratedLength(table=table)
    _serve(predictor, _request("r0", [10_000_000]))  # a million times the estimate
    after_one = predictor.factor(RequestPast.of(_request("r1", [10]), 0))
    w = PRIOR_WEIGHT  # the ratio, clipped, counts in its class and in its position's pool, each shrunk by w
    assert after_one == pytest.approx(MAX_FACTOR ** ((1 + 2 * w) / (1 + w) ** 2))
    assert after_one < 8
    # once a class has seen 20 replies at their estimate, one outlier moves it by under 25%
    warm = CalibratedLength(table=table)
    for i in range(20):
        _serve(warm, _request(f"r{i}", [10]))
    _serve(warm, _request("r20", [10_000_000]))
    assert 1 < warm.factor(RequestPast.of(_request("r21", [10]), 0)) < 1.25
    for i in range(1, 50):
        _serve(predictor, _request(f"r{i}", [10_000_000]))
    assert predictor.factor(RequestPast.of(_request("r0", [10]), 0)) <= MAX_FACTOR
    assert predictor.predict(_request("r0", [10]), 0) <= 10 * MAX_FACTOR
    # and the other way: at least 1 token, at least 1/MAX_FACTOR of the estimate
    tiny = CalibratedLength(table={f"r{i}": [10_000] for i in range(50)})
    for i in range(50):
        _serve(tiny, _request(f"r{i}", [1]))
    assert tiny.factor(RequestPast.of(_request("r0", [1]), 0)) >= 1 / MAX_FACTOR
    assert tiny.predict(_request("r0", [1]), 0) >= 10_000 / MAX_FACTOR


def test_classes_and_positions_learn_apart():
    table = {f"r{i}": [100, 100] for i in range(20)}
    predictor = CalibratedLength(table=table)
    for i in range(10):
        _serve(predictor, _request(f"r{i}", [500, 100], "tts"))
    tts = predictor.predict(_request("r10", [1, 1], "tts"), 0)
    chat = predictor.predict(_request("r10", [1, 1], "chat"), 0)
    assert tts > chat > 100  # chat's first segments: shrunk toward every class's first segments
    later = predictor.class_log_factor(RequestPast.of(_request("r10", [1, 1], "tts"), 1))
    assert later == pytest.approx(0.0)  # later segments were served at their estimate


def test_it_ignores_the_current_and_later_segments_truth():
    table = {"x": [80, 80, 80, 80], "warm": [50, 50]}
    for index in range(4):
        predictions = []
        for variant in (1, 2):
            predictor = CalibratedLength(table=table)
            _serve(predictor, _request("warm", [150, 20]))
            lengths = [70, 90, 30, 40]
            # the two requests differ only from segment `index` on
            lengths[index:] = [n * (7 if variant == 2 else 1) + variant for n in lengths[index:]]
            predictions.append(predictor.predict(_request("x", lengths), index))
        assert predictions[0] == predictions[1]


def test_segments_without_text_get_the_online_rule():
    calibrated = CalibratedLength(table={"text": [100]})
    online = OnlineLength()
    requests = [_request(f"r{i}", [40 + 10 * i, 200 - 7 * i, 30]) for i in range(6)] + [_request("text", [900])]
    for request in requests:
        for index, segment in enumerate(request.segments):
            past = RequestPast.of(request, index)
            if request.request_id != "text":
                assert calibrated.predict_past(past) == online.predict_past(past)
            calibrated.observe_output(past, segment.output_tokens)
            online.observe_output(past, segment.output_tokens)


def test_a_sampled_request_reads_its_template_estimates():
    template = _request("t", [50, 50])
    predictor = CalibratedLength(table={"t": [123, 45]})
    assert predictor.predict(template.arriving_at(3.0, "t#7"), 0) == 123


def test_it_is_knowable_and_rejects_bad_settings():
    assert SegmentPredictor(CalibratedLength(table={}), PastMeanApi()).knowable
    with pytest.raises(ValueError):
        CalibratedLength(table={}, max_factor=0.5)
    with pytest.raises(ValueError):
        CalibratedLength(table={}, prior_weight=0)


# --- the evaluation's replay and metrics --------------------------------------------------------


SESSIONS = [("s0", [(100, 10), (200, 40), (300, 20)]), ("s1", [(50, 80), (90, 160)]),
            ("s2", [(70, 30), (120, 60), (160, 90), (200, 15)])]


def test_the_replay_predicts_from_the_past_then_observes():
    table = table_of(SESSIONS, [5, 20, 10, 40, 80, 15, 30, 45, 8])
    raw = compare(SESSIONS, {"h": [5, 20, 10, 40, 80, 15, 30, 45, 8]}, scales=(1.0,))
    assert list(true_lengths(SESSIONS)) == [10, 40, 20, 80, 160, 30, 60, 90, 15]
    # the head's estimates are about half the truth: the raw head ranks perfectly, MAE by hand
    assert raw["hx1/raw"]["all"]["kendall_tau"] == pytest.approx(1.0)
    assert raw["hx1/raw"]["all"]["mae_tokens"] == pytest.approx((5 + 20 + 10 + 40 + 80 + 15 + 30 + 45 + 7) / 9)
    assert raw["hx1/raw"]["all"]["n"] == 9
    calibrated = replay(SESSIONS, CalibratedLength(table=table))
    assert calibrated[0] == 5  # nothing served yet
    assert raw["hx1/calibrated"]["all"]["mae_tokens"] < raw["hx1/raw"]["all"]["mae_tokens"]
    assert {"online", "hx1/class-only", "hx1/request-only"} <= set(raw)
    assert "warm" not in raw["hx1/raw"]  # three sessions: all are warm-up


def test_a_head_off_by_30x_keeps_its_rank_and_the_calibration_recovers_its_scale():
    rng = np.random.default_rng(0)
    sessions = [(f"s{k}", [(100 * (j + 1), int(rng.integers(5, 400))) for j in range(6)]) for k in range(12)]
    truth = true_lengths(sessions)
    estimate = truth * np.exp(rng.normal(0, 0.3, len(truth)))  # a fair head, some noise
    result = compare(sessions, {"h": estimate})
    for scale in ("1", "30", "1/30"):
        assert result[f"hx{scale}/raw"]["all"]["kendall_tau"] == pytest.approx(result["hx1/raw"]["all"]["kendall_tau"],
                                                                               abs=0.02)
    off = [result[f"hx{s}/raw"]["all"]["mae_tokens"] for s in ("30", "1/30")]
    fixed = [result[f"hx{s}/calibrated"]["warm"]["mae_tokens"] for s in ("30", "1/30")]
    assert all(f < o / 2 for f, o in zip(fixed, off))
    # once warm, the head off by 30x either way is calibrated to within 30% of the fair head's error
    assert all(f < 1.3 * result["hx1/raw"]["warm"]["mae_tokens"] for f in fixed)
    assert result["hx1/calibrated"]["all"]["mae_tokens"] < 1.3 * result["hx1/raw"]["all"]["mae_tokens"]
    assert result["online"]["all"]["mae_tokens"] > result["hx1/calibrated"]["all"]["mae_tokens"]


# --- the trace's head estimates read only the past ----------------------------------------------


def _trace(tmp_path, name: str, tail: str):
    record = [
        {"prompt": "Tell me about tea.", "completion": "Tea is a drink. " * 5, "api_token": "And coffee?",
         "api_time": 1.0},
        {"prompt": "x", "completion": "Coffee is a drink too. " * 3 + tail, "api_token": "And water?" + tail,
         "api_time": 2.0},
        {"prompt": "x", "completion": "Water. " + tail * 3},
    ]
    path = tmp_path / name
    path.write_text(json.dumps({"0": record}))
    return str(path)


def test_the_text_a_segment_is_predicted_from_does_not_depend_on_its_own_output(tmp_path):
    from marsched.predict.texts import text_segments

    short, long = _trace(tmp_path, "a.json", ""), _trace(tmp_path, "b.json", " More words here." * 20)
    a, b = text_segments(short)["0"], text_segments(long)["0"]
    assert a[1].output_tokens != b[1].output_tokens  # segment 1 differs in its own length and later
    for index in (0, 1):  # what the head reads for segments 0 and 1 is the same
        assert (a[index].last_turn, a[index].context_tokens, a[index].previous_output_tokens) == \
               (b[index].last_turn, b[index].context_tokens, b[index].previous_output_tokens)


@needs_extra
def test_the_spec_parses_prepares_and_predicts_a_trace(tmp_path):
    if not _extra_installed():
        pytest.skip("the predict extra is not installed")
    from marsched.predict.length import parse_length_predictor, prepare_length_predictor
    from marsched.workload.loader import load_trace

    predictor = parse_length_predictor("learned-online")
    assert isinstance(predictor, CalibratedLength) and predictor.knowable and predictor.name == "learned-online"
    assert parse_length_predictor("learned-online:agent").name.startswith("learned-online:")
    short, long = _trace(tmp_path, "a.json", ""), _trace(tmp_path, "b.json", " More words here." * 20)
    predictions = []
    for path in (short, long):
        fresh = CalibratedLength()
        prepare_length_predictor(fresh, load_trace(path), path)
        predictions.append([fresh.predict(load_trace(path)[0], i) for i in (0, 1)])
    assert predictions[0] == predictions[1]

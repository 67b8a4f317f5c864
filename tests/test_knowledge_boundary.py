"""The knowledge boundary: a policy decides from a request's past and predictions, never from
the segments still to come (docs/policies.md, "The knowledge boundary")."""

import pytest

from marsched.bench.runner import RunSpec, run_one
from marsched.metrics.trace import EventTrace
from marsched.policy.registry import make_policy
from marsched.predict.online import OnlineLength, PastMeanApi
from marsched.predict.segment import SegmentPredictor
from marsched.sim.engine import Simulator
from marsched.workload import ApiCall, ApiType, build_request
from marsched.workload.past import RequestPast
from simhelpers import COST, small_profile


class Collected(EventTrace):
    enabled = True

    def __init__(self) -> None:
        self.events: list[dict] = []

    def emit(self, event, t, rid=None, **fields):
        self.events.append({"event": event, "t": t, "rid": rid, **fields})


def _requests(future: str):
    """Six requests that share their first segment and call; `future` decides what comes after."""
    requests = []
    for i in range(6):
        first = (40 + 15 * i, ApiCall(ApiType.TOOL, 0.5 + 0.2 * i, 30))
        if future == "short":
            rest = [(20, None)]
        else:  # more calls, other lengths
            rest = [(90 + 10 * i, ApiCall(ApiType.TOOL, 3.0, 200)), (150, ApiCall(ApiType.OTHER, 1.0, 80)), (60, None)]
        requests.append(build_request(f"r{i}", 200 + 40 * i, [first, *rest], 0.01 * i))
    return requests


def _events_before_first_return(future: str, rest: str) -> list[dict]:
    policy = make_policy("mars", COST, SegmentPredictor(OnlineLength(), PastMeanApi()), rest=rest)
    trace = Collected()
    Simulator(_requests(future), small_profile(device_blocks=100, host_blocks=64), policy, trace).run()
    cut = next(i for i, e in enumerate(trace.events) if e["event"] == "api_end")
    return trace.events[:cut]


@pytest.mark.parametrize("rest", ["gittins", "mean"])
def test_runs_that_share_the_past_are_identical_until_the_first_call_returns(rest):
    short, long = _events_before_first_return("short", rest), _events_before_first_return("long", rest)
    kinds = {e["event"] for e in short}
    assert {"admit", "assign_strategy", "api_start"} <= kinds
    assert any(e["event"] == "admit" and e.get("key_basis") for e in short)  # keys and their basis compared
    assert short == long


def test_the_plan_bound_reads_the_future_and_the_same_check_catches_it():
    # The bound sees the later segments: its first admissions already differ, so the check above
    # would fail for it (the boundary broken on purpose).
    assert _events_before_first_return("short", "plan") != _events_before_first_return("long", "plan")


def test_the_past_view_holds_no_later_segment():
    request = _requests("long")[2]
    past = RequestPast.of(request, 1)
    assert past.done == request.segments[:1]
    assert past.context_tokens == request.segments[1].context_tokens
    assert past.last_call_type == "tool" and past.segment_index == 1
    assert not hasattr(past, "segments")  # no way to the plan from the view
    with pytest.raises(IndexError, match="no segment 4"):
        RequestPast.of(request, 4)


def test_knowable_predictions_ignore_the_segment_and_its_call():
    length, api = OnlineLength(), PastMeanApi()
    predictor = SegmentPredictor(length, api)
    assert predictor.knowable and not SegmentPredictor.oracle().knowable
    a = build_request("a", 100, [(10, ApiCall(ApiType.MATH, 0.001, 5)), (7, None)])
    b = build_request("b", 100, [(900, ApiCall(ApiType.CHATBOT, 30.0, 300)), (7, None)])
    pa, pb = predictor.predict(a, 0), predictor.predict(b, 0)
    assert (pa.output_tokens, pa.api_duration_s, pa.api_return_tokens) == (pb.output_tokens, pb.api_duration_s,
                                                                         pb.api_return_tokens)
    assert pa.kept_tokens is None


def test_online_lengths_learn_from_served_segments_and_the_request_own_replies():
    length = OnlineLength()
    first = RequestPast("x", "math", 100, 100, ())
    assert length.predict_past(first) == 100  # the prior
    length.observe_output(first, 40)
    length.observe_output(first, 60)
    assert length.predict_past(first) == 50
    other_class = RequestPast("y", "qa", 100, 100, ())
    assert length.predict_past(other_class) == 50  # a class not seen yet: every class's mean
    request = build_request("z", 100, [(300, ApiCall(ApiType.MATH, 0.1, 5)), (10, None)])
    later = RequestPast.of(request, 1)
    assert length.predict_past(later) == round((300 + 50) / 2)  # its own reply and the class's, half each


def test_past_mean_api_follows_the_latest_call_tool():
    api = PastMeanApi()
    api.observe(ApiType.MATH, 0.001, 4)
    api.observe(ApiType.CHATBOT, 10.0, 100)
    request = build_request("z", 100, [(3, ApiCall(ApiType.CHATBOT, 9.0, 90)), (3, ApiCall(ApiType.MATH, 0.1, 1)),
                                       (5, None)])
    assert api.estimate(request, 1).duration_s == pytest.approx(10.0)
    assert api.estimate(request, 2).duration_s == pytest.approx(0.001)
    # Before any call, nothing said which tool: the mean over every tool (geometric).
    assert api.estimate(request, 0).duration_s == pytest.approx((0.001 * 10.0) ** 0.5)


def test_records_name_a_bound_as_one():
    templates = _requests("long")
    knowable = run_one(RunSpec("mars", 1.0, duration_s=5, profile="gptj-6b-a100"), templates)
    bound = run_one(RunSpec("mars", 1.0, duration_s=5, profile="gptj-6b-a100", predictor="foreknowledge"), templates)
    assert (knowable["bound"], knowable["rest"], knowable["predictor"]) == (False, "gittins", "online+api:past-mean")
    assert (bound["bound"], bound["rest"], bound["predictor"]) == (True, "plan", "foreknowledge+api:oracle")
    oracle_lengths = run_one(RunSpec("mars", 1.0, duration_s=5, predictor="oracle"), templates)
    assert oracle_lengths["bound"]  # the segment's own length, read from the trace


def test_a_gittins_key_is_the_least_rank_over_horizons_and_a_mean_key_adds_the_mean_rest():
    from marsched.policy.gittins import gittins_outlook
    from marsched.policy.load import EngineLoad
    from marsched.policy.program import rest_area_per_iteration
    from marsched.policy.progress import RequestProgress

    load = EngineLoad(0.0, 500, 0.03, 10_000)
    request = build_request("g", 300, [(50, ApiCall(ApiType.TOOL, 1.0, 40)), (30, None)])
    keys = {}
    for rest in ("gittins", "mean"):
        policy = make_policy("mars", COST, SegmentPredictor(OnlineLength(), PastMeanApi()), rest=rest)
        for turns in (1,) * 30 + (40,):  # thirty requests of one segment, one of forty
            policy.program_rest.ended("", build_request("e", 100, [(10, ApiCall(ApiType.TOOL, 1.0, 5))] * (turns - 1)
                                                        + [(10, None)]).segments)
        progress = RequestProgress(request, order_s=0.0)
        policy.start_segment(progress, load)
        alone = RequestProgress(request, order_s=0.0, predictions=progress.predictions, strategy=progress.strategy)
        current = policy.queue_key(alone, load)  # no program: the current segment only
        keys[rest] = policy.queue_key(progress, load)
        mean = progress.program if rest == "mean" else None
        if rest == "gittins":
            counts = policy.program_rest.lengths("").turns_left_counts(1)
            best = gittins_outlook(counts, current, 300, progress.program.output_tokens,
                                   progress.program.growth_tokens, load.iteration_s)
            assert progress.program == best and best.completion < 1
            expected = (current + load.iteration_s * rest_area_per_iteration(best, 300)) / best.completion
        else:
            expected = current + load.iteration_s * rest_area_per_iteration(mean, 300)
        assert keys[rest] == pytest.approx(expected)
    assert keys["gittins"] != keys["mean"]


def test_the_call_is_expected_when_the_requests_that_ended_make_it_likely_and_the_finish_teaches_it():
    from marsched.policy.load import EngineLoad
    from marsched.policy.progress import RequestProgress

    load = EngineLoad(0.0, 0, 0.03, 10_000)
    policy = make_policy("mars", COST, SegmentPredictor(OnlineLength(), PastMeanApi()), rest="gittins")
    one_segment = build_request("done", 100, [(10, None)])
    for _ in range(10):  # ten requests that ended after their first segment
        policy.observe_finish(RequestProgress(one_segment, order_s=0.0))
    assert len(policy.program_rest.lengths("")) == 10
    request = build_request("g", 300, [(50, ApiCall(ApiType.TOOL, 1.0, 40)), (30, None)])
    progress = RequestProgress(request, order_s=0.0)
    policy.start_segment(progress, load)
    assert not progress.predictions[0].has_call  # 10 of 14 (with the prior) ended there
    assert progress.strategy is not None  # a strategy is fixed all the same, for the call it may make
    assert not policy.kv_outlook(progress).held_after
    fresh = make_policy("mars", COST, SegmentPredictor(OnlineLength(), PastMeanApi()), rest="gittins")
    progress = RequestProgress(request, order_s=0.0)
    fresh.start_segment(progress, load)
    assert progress.predictions[0].has_call  # the prior: one more segment


def test_first_and_later_segments_are_predicted_apart():
    length = OnlineLength()
    first = RequestPast("x", "", 100, 100, ())
    later = RequestPast.of(build_request("z", 100, [(30, ApiCall(ApiType.TOOL, 0.1, 5)), (10, None)]), 1)
    for _ in range(3):
        length.observe_output(first, 10)
        length.observe_output(later, 200)
    assert length.predict_past(first) == 10
    assert length.predict_past(later) == round((30 + 200) / 2)


def test_a_finish_teaches_what_was_generated_where_the_request_holds_only_a_plan():
    """vLLM's requests hold max_tokens as their plan: online lengths must learn the reply served."""
    from marsched.policy.progress import RequestProgress

    policy = make_policy("mars", COST, SegmentPredictor(OnlineLength(), PastMeanApi()), rest="gittins")
    planned = build_request("turn", 100, [(4096, None)])  # the plan: max_tokens
    for _ in range(5):
        policy.observe_finish(RequestProgress(planned, order_s=0.0), last_output_tokens=40)
    past = RequestPast.of(build_request("next", 100, [(4096, None)]), 0)
    assert policy.predictor.length.predict_past(past) == 40
    policy.observe_finish(RequestProgress(planned, order_s=0.0))  # the simulator: the segment is what ran
    assert policy.predictor.length.predict_past(past) > 40


@pytest.mark.parametrize("declared", [True, False])
def test_a_declared_plan_still_teaches_the_online_predictor_and_the_trace_plan_bound_does_not(declared):
    """A live server's key reads the plan its client declared (`Policy.plan_is_declared`): its online
    predictor learns from every request that ends. Under the simulator's plan bound it never did,
    and its tables stay as they were."""
    from dataclasses import replace

    from marsched.policy.progress import RequestProgress

    policy = replace(make_policy("mars", COST, SegmentPredictor(OnlineLength(), PastMeanApi())),
                     plan_is_declared=declared)
    planned = build_request("turn", 100, [(4096, None)])
    for _ in range(3):
        policy.observe_finish(RequestProgress(planned, order_s=0.0), last_output_tokens=12)
    past = RequestPast.of(build_request("next", 100, [(4096, None)]), 0)
    assert policy.predictor.length.predict_past(past) == (12 if declared else 100)
    assert len(policy.program_rest.lengths("")) == 0  # the program's rest is the ledger's, not the policy's

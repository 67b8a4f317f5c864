"""The predictors learnt online from the past (`predict/online.py`): what each returns, and which
past it learns from (the task class, the segment's position, the tool of the latest call)."""

from dataclasses import replace

import pytest

from marsched.predict.api_duration import SHORTEST_S
from marsched.predict.online import PRIOR_DURATION_S, PRIOR_RETURN_TOKENS, PRIOR_TOKENS, OnlineLength, PastMeanApi
from marsched.workload import ApiCall, ApiType, build_request
from marsched.workload.past import RequestPast


def _first(task_class: str) -> RequestPast:
    """A request of `task_class` at its first segment."""
    return RequestPast(f"first-{task_class}", task_class, 100, 100, ())


def _later(task_class: str, own_reply: int, tool: ApiType = ApiType.TOOL) -> RequestPast:
    """A request of `task_class` at its second segment, after a reply of `own_reply` tokens and a call of `tool`."""
    request = build_request(f"later-{task_class}", 100, [(own_reply, ApiCall(tool, 0.5, 5)), (10, None)])
    return RequestPast.of(replace(request, task_class=task_class), 1)


# OnlineLength


def test_each_class_is_predicted_from_its_own_replies_and_an_unseen_class_from_every_class():
    length = OnlineLength()
    for _ in range(2):
        length.observe_output(_first("math"), 10)
        length.observe_output(_first("qa"), 300)
    assert length.predict_past(_first("math")) == 10
    assert length.predict_past(_first("qa")) == 300
    assert length.predict_past(_first("chatbot")) == 155  # no chatbot reply served yet: the mean of all four


def test_an_unseen_class_takes_the_mean_of_its_own_position_not_the_other():
    length = OnlineLength()
    length.observe_output(_first("math"), 20)  # the first position is seen first
    for _ in range(3):
        length.observe_output(_later("math", 50), 1000)
    assert length.predict_past(_first("qa")) == 20  # qa's first segment: the first segments' mean only
    # qa's later segment: its own reply (40) and the later segments' mean (1000), half each.
    assert length.predict_past(_later("qa", 40)) == 520


def test_before_any_segment_of_a_position_the_other_position_speaks_and_before_any_the_prior():
    length = OnlineLength()
    assert length.predict_past(_first("math")) == PRIOR_TOKENS
    assert length.predict_past(_later("math", 300)) == round((300 + PRIOR_TOKENS) / 2)
    length.observe_output(_later("math", 50), 60)
    assert length.predict_past(_first("math")) == 60  # no first segment served yet: the later ones' mean
    assert length.predict_past(_first("qa")) == 60


def test_replies_of_one_token_predict_one_token_and_an_empty_reply_still_predicts_one():
    length = OnlineLength()
    for _ in range(4):
        length.observe_output(_first("tts"), 1)  # a reply that is only the call
    assert length.predict_past(_first("tts")) == 1
    empty = OnlineLength()
    empty.observe_output(_first("tts"), 0)
    assert empty.predict_past(_first("tts")) == 1  # a segment runs at least one iteration


def test_predict_reads_the_request_only_up_to_the_segment_it_starts():
    length = OnlineLength()
    length.observe_output(_first(""), 50)
    request = build_request("r", 100, [(300, ApiCall(ApiType.MATH, 0.1, 5)), (8, ApiCall(ApiType.MATH, 0.1, 5)),
                                       (2, None)])
    assert length.predict(request, 0) == 50  # not its own 300: not generated yet
    assert length.predict(request, 1) == 175  # its first reply (300) and the class mean (50), half each
    assert length.predict(request, 2) == round((300 + 8 + 50) / 3)
    with pytest.raises(IndexError, match="no segment 3"):
        length.predict(request, 3)


# PastMeanApi


def test_durations_and_returns_are_learnt_per_tool_of_the_latest_call():
    api = PastMeanApi()
    before = api.estimate_past(_later("", 10, ApiType.MATH))
    assert (before.duration_s, before.return_tokens) == (PRIOR_DURATION_S, PRIOR_RETURN_TOKENS)
    for duration_s, returns in ((0.001, 4), (0.004, 6)):
        api.observe(ApiType.MATH, duration_s, returns)
    api.observe(ApiType.CHATBOT, 10.0, 100)
    math_next = api.estimate_past(_later("", 10, ApiType.MATH))
    assert math_next.duration_s == pytest.approx(0.002)  # geometric mean of the math calls
    assert math_next.return_tokens == 5
    chat_next = api.estimate_past(_later("", 10, ApiType.CHATBOT))
    assert (chat_next.duration_s, chat_next.return_tokens) == (pytest.approx(10.0), 100)
    # No call yet and a class with no tool of its name: every call seen.
    anything = api.estimate_past(_first(""))
    assert anything.duration_s == pytest.approx((0.001 * 0.004 * 10.0) ** (1 / 3))
    assert anything.return_tokens == round((4 + 6 + 100) / 3)


def test_a_tool_not_seen_yet_is_estimated_from_every_call_seen_not_the_prior():
    api = PastMeanApi()
    api.observe(ApiType.MATH, 0.01, 8)
    api.observe(ApiType.MATH, 0.01, 8)
    for past in (_later("", 10, ApiType.TTS), _first("qa")):  # a latest call of an unseen tool; an unseen class
        estimate = api.estimate_past(past)
        assert (estimate.duration_s, estimate.return_tokens) == (pytest.approx(0.01), 8)


def test_the_class_names_the_tool_before_the_first_call():
    api = PastMeanApi()
    api.observe(ApiType.QA, 2.0, 30)
    api.observe(ApiType.MATH, 0.002, 3)
    estimate = api.estimate_past(_first("qa"))
    assert (estimate.duration_s, estimate.return_tokens) == (pytest.approx(2.0), 30)


def test_a_declared_expectation_counts_as_one_call_of_its_tool_until_calls_are_seen():
    api = PastMeanApi()
    api.declare(ApiType.TTS, 4.0, 30)
    declared = api.estimate(build_request("r", 100, [(5, ApiCall(ApiType.TTS, 99.0, 999)), (5, None)]), 1)
    assert (declared.duration_s, declared.return_tokens) == (pytest.approx(4.0), 30)
    api.observe(ApiType.TTS, 16.0, 50)
    both = api.estimate_past(_later("", 10, ApiType.TTS))
    assert both.duration_s == pytest.approx(8.0)  # geometric mean of the declared 4 s and the 16 s seen
    assert both.return_tokens == 40
    api.declare(ApiType.TTS, 1000.0, 1)  # calls of it were seen: their history stands
    again = api.estimate_past(_later("", 10, ApiType.TTS))
    assert (again.duration_s, again.return_tokens) == (pytest.approx(8.0), 40)


def test_a_tool_declared_as_instant_is_the_shortest_duration():
    api = PastMeanApi()
    api.declare(ApiType.MATH, 0.0, 2)
    estimate = api.estimate_past(_later("", 10, ApiType.MATH))
    assert (estimate.duration_s, estimate.return_tokens) == (pytest.approx(SHORTEST_S), 2)

"""The marks that tell the scheduler a request ended on a stop string (`marsched.vllm.stop_strings`);
tests/test_serve_conversations.py runs them on a live server."""

from dataclasses import dataclass, field

from marsched.vllm.retention import RELEASE_PREFIX
from marsched.vllm.stop_strings import STOPPED_PREFIX, mark_stop_string_ends, split_marked


@dataclass
class Output:  # the shape of vLLM's OutputProcessorOutput that the marks use
    reqs_to_abort: list[str] = field(default_factory=list)


class Processor:
    def __init__(self, ended: list[list[str]]) -> None:
        self.ended = ended

    def process_outputs(self, outputs, now=None):
        return Output(list(self.ended.pop(0)))


class Engine:
    def __init__(self, processor) -> None:
        self.output_processor = processor


def test_each_stop_string_abort_carries_its_mark_once():
    engine = Engine(Processor([["a", "b"], []]))
    assert mark_stop_string_ends(engine) and not mark_stop_string_ends(engine)  # wrapped once
    assert engine.output_processor.process_outputs("x", now=1.0).reqs_to_abort == [
        "a", "b", STOPPED_PREFIX + "a", STOPPED_PREFIX + "b"]
    assert engine.output_processor.process_outputs("y").reqs_to_abort == []  # nothing ended: nothing added


def test_an_engine_client_without_an_output_processor_is_left_alone():
    assert not mark_stop_string_ends(object())


def test_split_takes_the_marks_out_and_names_their_requests():
    ids, stopped = split_marked(["a", STOPPED_PREFIX + "a", "c", STOPPED_PREFIX + "gone"], STOPPED_PREFIX)
    assert ids == ["a", "c"] and stopped == ["a", "gone"]
    assert split_marked(["a"], STOPPED_PREFIX) == (["a"], [])
    # A release mark is left for its own split, and the other way round.
    message = ["a", RELEASE_PREFIX + "chat-1", STOPPED_PREFIX + "a"]
    assert split_marked(message, RELEASE_PREFIX) == (["a", STOPPED_PREFIX + "a"], ["chat-1"])

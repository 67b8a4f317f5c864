"""A trained head: a small MLP over encoder features, stored as one numpy .npz, run with numpy.

Two formulations (`kind`):

- ``bins``: the MARS paper's, a classifier over 50 bins of 10 tokens (bin b holds lengths
  10b to 10b+9; the last bin also holds everything longer). The prediction is the median
  bin of the predicted distribution, read as a length by `bin_lengths` (its centre, and for
  the last bin the mean training length of what fell in it).
- ``log``: a regressor on log(1 + length); the prediction is exp(output) - 1.

The file holds the input standardisation, the layers' weights and the metadata (encoder,
formulation, what it was trained on) as a JSON string, so a head is self-describing and
loading it runs no code from the file (`allow_pickle=False`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import numpy as np

BINS = 50
BIN_TOKENS = 10
HEAD_KINDS = ("bins", "log")
HEAD_FILE = "head.npz"


def length_bin(tokens: np.ndarray | int) -> np.ndarray:
    """The MARS bin of a length: 10 tokens a bin, the last bin open-ended."""
    return np.minimum(np.asarray(tokens) // BIN_TOKENS, BINS - 1)


@dataclass(frozen=True)
class Head:
    kind: str
    mean: np.ndarray  # input standardisation
    scale: np.ndarray
    weights: tuple[np.ndarray, ...]
    biases: tuple[np.ndarray, ...]
    bin_lengths: np.ndarray | None = None  # kind "bins": the length each bin stands for
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in HEAD_KINDS:
            raise ValueError(f"unknown head kind {self.kind!r}; valid: {', '.join(HEAD_KINDS)}")
        if self.kind == "bins" and (self.bin_lengths is None or len(self.bin_lengths) != BINS):
            raise ValueError(f"a 'bins' head needs {BINS} bin lengths")

    def outputs(self, features: np.ndarray) -> np.ndarray:
        x = (np.asarray(features, dtype=np.float32) - self.mean) / self.scale
        for index, (weight, bias) in enumerate(zip(self.weights, self.biases)):
            x = x @ weight + bias
            if index < len(self.weights) - 1:
                np.maximum(x, 0.0, out=x)
        return x

    def predict(self, features: np.ndarray) -> np.ndarray:
        """Predicted lengths in tokens (floats, at least 1)."""
        out = self.outputs(features)
        if self.kind == "bins":
            # the median bin of the predicted distribution: the point that minimises the expected
            # absolute error (the most likely bin is often the open last one, far from most lengths)
            out = np.exp(out - out.max(axis=1, keepdims=True))
            cumulative = np.cumsum(out / out.sum(axis=1, keepdims=True), axis=1)
            lengths = self.bin_lengths[np.argmax(cumulative >= 0.5, axis=1)]
        else:
            lengths = np.expm1(out[:, 0])
        low, high = self.meta.get("clip", (1.0, np.inf))
        return np.clip(lengths, max(low, 1.0), high)

    @property
    def parameters(self) -> int:
        return sum(w.size + b.size for w, b in zip(self.weights, self.biases))

    def save(self, directory: str | os.PathLike[str]) -> str:
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, HEAD_FILE)
        arrays = {"mean": self.mean, "scale": self.scale}
        for index, (weight, bias) in enumerate(zip(self.weights, self.biases)):
            arrays[f"w{index}"] = weight.astype(np.float32)
            arrays[f"b{index}"] = bias.astype(np.float32)
        if self.bin_lengths is not None:
            arrays["bin_lengths"] = self.bin_lengths.astype(np.float32)
        meta = {**self.meta, "kind": self.kind, "layers": len(self.weights)}
        np.savez_compressed(path, meta=np.array(json.dumps(meta, sort_keys=True)), **arrays)
        return path


def load_head(directory: str | os.PathLike[str]) -> Head:
    """The head saved in `directory`; ValueError naming the file and what is wrong."""
    path = os.path.join(directory, HEAD_FILE)
    if not os.path.isfile(path):
        raise ValueError(f"{path}: no trained head here (make one with `marsched predictor train --out DIR`)")
    try:
        with np.load(path, allow_pickle=False) as data:
            meta = json.loads(str(data["meta"]))
            layers = int(meta["layers"])
            weights = tuple(data[f"w{i}"] for i in range(layers))
            biases = tuple(data[f"b{i}"] for i in range(layers))
            bin_lengths = data["bin_lengths"] if "bin_lengths" in data.files else None
            mean, scale = data["mean"], data["scale"]
    except (OSError, ValueError, KeyError) as error:
        raise ValueError(f"{path}: not a marsched predictor head ({error})") from None
    return Head(meta["kind"], mean, scale, weights, biases, bin_lengths, meta)

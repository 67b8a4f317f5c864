"""Train and evaluate the learned length predictor (`marsched predictor train|eval`).

The data (`examples`): ShareGPT assistant turns and the INFERCEPT traces' text records,
split by conversation with a fixed seed into train and held-out. Training holds out a further
validation part of train (the same rule, another seed) to choose between the two heads
(`head`: the MARS 50 × 10-token bins, or a regression on log length) by Kendall's tau on it;
the held-out split is touched only by `evaluate`. The chosen head is refitted on nothing
more: it is the one validated. Training needs torch (the `predict` extra, for torch); the saved
head runs on numpy alone.

Everything runs in one process on one thread: the machines this is trained on are shared.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from marsched.predict import metrics
from marsched.predict.encoder import Encoder
from marsched.predict.examples import (
    TRACE_FAMILIES,
    Example,
    assign_groups,
    first_human_messages,
    read_sharegpt_records,
    sharegpt_examples,
    split,
    trace_examples,
)
from marsched.predict.head import BIN_TOKENS, BINS, HEAD_KINDS, Head, length_bin, load_head

VALIDATION_SEED_OFFSET = 1000  # the validation split's seed: the split's seed plus this
REPORT_FILE = "train.json"


@dataclass(frozen=True, slots=True)
class TrainConfig:
    seed: int = 0
    held_out: float = 0.2  # share of conversations in the held-out split
    validation: float = 0.15  # share of the training conversations used to choose the head
    max_conversations: int | None = None  # ShareGPT conversations kept (of 9,460 in the package); None: all
    encoder: str = "embed"
    hidden: int = 128
    epochs: int = 12
    heads: tuple[str, ...] = HEAD_KINDS


@dataclass(frozen=True, slots=True)
class Dataset:
    train: list[Example]
    test: list[Example]


def build_dataset(config: TrainConfig, log: Callable[[str], None] = lambda _: None) -> Dataset:
    """The examples of both sources, split by conversation (`examples` says how)."""
    records = read_sharegpt_records()
    log(f"ShareGPT: {len(records)} records in the package")
    examples = sharegpt_examples(records, config.max_conversations, config.seed)
    firsts = first_human_messages(records)
    for trace in TRACE_FAMILIES:
        examples += assign_groups(trace_examples(trace), firsts)
    train, test = split(examples, config.seed, config.held_out)
    log(f"examples: {len(train)} train, {len(test)} held out "
        f"({sum(e.source != 'sharegpt' for e in examples)} from trace text records)")
    return Dataset(train, test)


def encode(encoder: Encoder, examples: Sequence[Example], batch: int = 64) -> np.ndarray:
    rows = []
    for start in range(0, len(examples), batch):
        part = examples[start:start + batch]
        rows.append(encoder.encode([e.last_turn for e in part], [e.context_tokens for e in part],
                                   [e.previous_output_tokens for e in part]))
    return np.concatenate(rows) if rows else np.zeros((0, encoder.dim), dtype=np.float32)


def lengths(examples: Sequence[Example]) -> np.ndarray:
    return np.array([e.output_tokens for e in examples], dtype=np.float64)


def fit_head(kind: str, features: np.ndarray, y: np.ndarray, config: TrainConfig) -> Head:
    """An MLP head of one hidden layer, trained with torch on one thread, exported to numpy.

    ``bins``: cross-entropy over the 50 bins. ``log``: absolute error on log(1 + length), a
    median regression (the point that minimises the absolute error, which MAE measures; a
    squared loss chases ShareGPT's replies of thousands of tokens).
    """
    import torch

    torch.manual_seed(config.seed)
    mean = features.mean(axis=0).astype(np.float32)
    scale = (features.std(axis=0) + 1e-6).astype(np.float32)
    x = torch.from_numpy(((features - mean) / scale).astype(np.float32))
    outputs = BINS if kind == "bins" else 1
    model = torch.nn.Sequential(torch.nn.Linear(x.shape[1], config.hidden), torch.nn.ReLU(),
                                torch.nn.Dropout(0.1), torch.nn.Linear(config.hidden, outputs))
    if kind == "bins":
        target = torch.from_numpy(length_bin(y.astype(np.int64)))
        loss_fn = torch.nn.functional.cross_entropy
    else:
        target = torch.from_numpy(np.log1p(y).astype(np.float32))
        loss_fn = lambda out, t: (out[:, 0] - t).abs().mean()  # noqa: E731
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-2)
    generator = torch.Generator().manual_seed(config.seed)
    model.train()
    for _ in range(config.epochs):
        for batch in torch.randperm(len(x), generator=generator).split(256):
            optimizer.zero_grad()
            loss_fn(model(x[batch]), target[batch]).backward()
            optimizer.step()
    first, last = model[0], model[3]
    weights = (first.weight.detach().numpy().T.copy(), last.weight.detach().numpy().T.copy())
    biases = (first.bias.detach().numpy().copy(), last.bias.detach().numpy().copy())
    meta = {"encoder": config.encoder, "max_tokens": Encoder().max_tokens, "previous_feature": True,
            "train": asdict(config), "clip": [1.0, float(y.max())]}
    centres = None
    if kind == "bins":
        centres = np.arange(BINS) * BIN_TOKENS + BIN_TOKENS / 2
        tail = y[y >= (BINS - 1) * BIN_TOKENS]
        centres[-1] = tail.mean() if len(tail) else centres[-1]  # the open bin stands for its training mean
        centres = centres.astype(np.float32)
    return Head(kind, mean, scale, weights, biases, centres, meta)


def train(out: str | os.PathLike[str], config: TrainConfig = TrainConfig(),
          log: Callable[[str], None] = lambda _: None) -> dict:
    """Train every head kind, keep the best on validation in `out` (head.npz), report in train.json."""
    started = time.perf_counter()
    data = build_dataset(config, log)
    fit_part, validation = split(data.train, config.seed + VALIDATION_SEED_OFFSET, config.validation)
    encoder = Encoder(config.encoder)
    log(f"encoding {len(data.train)} training examples with the {config.encoder} encoder")
    x_fit, x_val = encode(encoder, fit_part), encode(encoder, validation)
    y_fit, y_val = lengths(fit_part), lengths(validation)
    candidates = {}
    for kind in config.heads:
        head = fit_head(kind, x_fit, y_fit, config)
        candidates[kind] = (head, metrics.report(head.predict(x_val), y_val))
        log(f"head {kind}: validation {_line(candidates[kind][1])}")
    best = max(candidates, key=lambda k: (candidates[k][1]["kendall_tau"], -candidates[k][1]["mae_tokens"]))
    head = candidates[best][0]
    head = Head(head.kind, head.mean, head.scale, head.weights, head.biases, head.bin_lengths,
                {**head.meta, "chosen_over": sorted(set(candidates) - {best}),
                 "validation": {k: m for k, (_, m) in candidates.items()}})
    path = head.save(out)
    report = {"head": os.path.basename(path), "chosen": best, "validation": {k: m for k, (_, m) in candidates.items()},
              "train_examples": len(fit_part), "validation_examples": len(validation),
              "held_out_examples": len(data.test), "parameters": head.parameters,
              "seconds": round(time.perf_counter() - started, 1), "config": asdict(config)}
    with open(os.path.join(out, REPORT_FILE), "w") as handle:
        json.dump(report, handle, indent=2)
    log(f"kept the {best} head ({head.parameters} parameters): {path}")
    return report


def evaluate(directory: str | os.PathLike[str], log: Callable[[str], None] = lambda _: None) -> dict:
    """The head in `directory` and the baselines on its held-out split, overall and per source."""
    head = load_head(directory)
    config = TrainConfig(**{k: tuple(v) if k == "heads" else v for k, v in head.meta.get("train", {}).items()})
    data = build_dataset(config, log)
    encoder = Encoder(head.meta.get("encoder", "embed"), head.meta.get("max_tokens", 128),
                      bool(head.meta.get("previous_feature", False)))
    log(f"encoding {len(data.test)} held-out examples")
    predictions = {
        "learned": head.predict(encode(encoder, data.test)),
        **{name: fit(data.train)(data.test) for name, fit in BASELINES.items()},
    }
    y = lengths(data.test)
    sources = sorted({e.source for e in data.test})
    result: dict = {"directory": str(directory), "head": head.kind, "encoder": encoder.kind,
                    "held_out_examples": len(data.test), "train_examples": len(data.train), "all": {}, "by_source": {}}
    for name, predicted in predictions.items():
        result["all"][name] = metrics.report(predicted, y)
        for source in sources:
            mask = np.array([e.source == source for e in data.test])
            result["by_source"].setdefault(source, {})[name] = metrics.report(predicted[mask], y[mask])
    per_type = result["all"]["type-mean"]["mae_tokens"]
    result["mae_below_type_mean"] = 1 - result["all"]["learned"]["mae_tokens"] / per_type if per_type else 0.0
    return result


def _global_mean(train: Sequence[Example]) -> Callable[[Sequence[Example]], np.ndarray]:
    mean = float(lengths(train).mean())
    return lambda test: np.full(len(test), mean)


def _type_mean(train: Sequence[Example]) -> Callable[[Sequence[Example]], np.ndarray]:
    y = lengths(train)
    means = {t: float(y[[e.api_type == t for e in train]].mean()) for t in {e.api_type for e in train}}
    overall = float(y.mean())
    return lambda test: np.array([means.get(e.api_type, overall) for e in test])


def _prompt_length_features(examples: Sequence[Example]) -> np.ndarray:
    return np.array([[1.0, np.log1p(e.context_tokens), np.log1p(e.last_turn_tokens)] for e in examples])


def _prompt_length_regression(train: Sequence[Example]) -> Callable[[Sequence[Example]], np.ndarray]:
    """Least squares of log(1 + length) on log(1 + context tokens) and log(1 + last-turn tokens)."""
    coef, *_ = np.linalg.lstsq(_prompt_length_features(train), np.log1p(lengths(train)), rcond=None)
    return lambda test: np.maximum(np.expm1(_prompt_length_features(test) @ coef), 1.0)


BASELINES: dict[str, Callable[[Sequence[Example]], Callable[[Sequence[Example]], np.ndarray]]] = {
    "global-mean": _global_mean,
    "type-mean": _type_mean,
    "prompt-length": _prompt_length_regression,
}


def _line(report: dict) -> str:
    return (f"Acc-5 {report['acc5']:.3f}  Acc-15 {report['acc15']:.3f}  MAE {report['mae_tokens']:.1f}  "
            f"tau {report['kendall_tau']:.3f}  (n={report['n']})")

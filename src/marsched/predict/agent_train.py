"""Train and evaluate the length predictor on agent turns (`marsched predictor train|eval --data agent-text`).

The examples and the split by session are `marsched.predict.agent_examples`'s. The head and
its training are `marsched.predict.train`'s (`fit_head`, the same MLP over the same encoder);
what differs is the data and how a head is chosen:

- **Candidates.** Each head kind (``bins``, ``log``) trained on the agent turns *alone*, and
  *mixed*: the agent turns, each repeated `oversample` times, beside the ShareGPT and trace
  training split of `train.build_dataset` (the default head's, so that the default head's
  held-out evaluation stays held out for a mixed head too).
- **Choice.** By cross-validation over the training sessions: `folds` folds of whole
  sessions (`agent_examples.session_folds`, seed + `VALIDATION_SEED_OFFSET`), each candidate
  fitted on the other folds and scored on its out-of-fold predictions of every training turn,
  by Kendall's tau (then MAE). A single validation part (9 of the 31 training sessions) was
  too noisy to choose: its order of the two best candidates flipped with a small change of
  the features. The chosen candidate is then refitted on all training sessions; that refit is
  what is saved.
- **Evaluation** (`evaluate_agent`): on the held-out sessions only, the head against the
  packaged default head and three baselines fitted on the training sessions: the mean reply
  length per turn type (family × first turn or follow-up, `agent_examples.turn_type`), the
  global mean, and a constant `max_tokens` cap (its Kendall's tau is 0 by definition: a
  constant ranks nothing).

The saved head's metadata keeps `train` (the `TrainConfig` of its fit, which also names the
ShareGPT split, so `train.evaluate` runs on it) and `agent_train` (this module's config).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from marsched.predict import metrics
from marsched.predict.agent_examples import AGENT_TEXT, HELD_OUT, agent_examples, session_folds, split_sessions
from marsched.predict.encoder import Encoder
from marsched.predict.examples import Example
from marsched.predict.head import HEAD_KINDS, Head, load_head
from marsched.predict.train import (
    BASELINES,
    REPORT_FILE,
    VALIDATION_SEED_OFFSET,
    TrainConfig,
    build_dataset,
    encode,
    fit_head,
    lengths,
)

MIXES = ("alone", "mixed")
MAX_TOKENS = 4096  # the constant cap of the `max_tokens` baseline: what a client that sends no prediction asks


@dataclass(frozen=True, slots=True)
class AgentTrainConfig:
    seed: int = 0
    held_out: float = HELD_OUT  # share of each family's sessions held out
    folds: int = 4  # cross-validation folds of the training sessions that choose the candidate
    encoder: str = "embed"
    hidden: int = 128
    epochs: int = 30  # alone: 825 turns, about 100 optimiser steps
    mixed_epochs: int = 12  # mixed: the ShareGPT split dominates the steps
    oversample: int = 20  # mixed: times each agent turn is repeated
    heads: tuple[str, ...] = HEAD_KINDS
    mixes: tuple[str, ...] = MIXES

    def fit_config(self, mix: str) -> TrainConfig:
        """The `TrainConfig` a candidate is fitted with (its seed and held-out share also name the ShareGPT split)."""
        return TrainConfig(seed=self.seed, encoder=self.encoder, hidden=self.hidden, heads=self.heads,
                           epochs=self.epochs if mix == "alone" else self.mixed_epochs)


@dataclass(frozen=True, slots=True)
class AgentDataset:
    train: list[Example]
    test: list[Example]


def agent_dataset(config: AgentTrainConfig, log: Callable[[str], None] = lambda _: None,
                  turn_chars: int = 0, reply_chars: int | None = None) -> AgentDataset:
    """The examples split by session; `turn_chars` and `reply_chars` cut them as `marsched loadgen` does."""
    log("reading the agent-text sessions (tokenizing 1,148 prompts)")
    train, test = split_sessions(agent_examples(turn_chars=turn_chars, reply_chars=reply_chars), config.seed,
                                 config.held_out)
    log(f"agent turns: {len(train)} train ({len({e.group for e in train})} sessions), "
        f"{len(test)} held out ({len({e.group for e in test})} sessions)")
    return AgentDataset(train, test)


def _fit(kind: str, mix: str, x: np.ndarray, y: np.ndarray, chat: tuple[np.ndarray, np.ndarray] | None,
         config: AgentTrainConfig) -> Head:
    if mix == "mixed":
        x = np.concatenate([chat[0]] + [x] * config.oversample)
        y = np.concatenate([chat[1]] + [y] * config.oversample)
    return fit_head(kind, x, y, config.fit_config(mix))


def train_agent(out: str | os.PathLike[str], config: AgentTrainConfig = AgentTrainConfig(),
                log: Callable[[str], None] = lambda _: None, data: AgentDataset | None = None) -> dict:
    """Cross-validate every candidate, refit the best on all training sessions, save it in `out`.

    `data`: the examples (None: the bundled sessions, `agent_dataset`); a test passes a few.
    """
    started = time.perf_counter()
    data = data or agent_dataset(config, log)
    fold = np.array(session_folds(data.train, config.seed + VALIDATION_SEED_OFFSET, config.folds))
    encoder = Encoder(config.encoder)
    x, y = encode(encoder, data.train), lengths(data.train)
    chat = None
    if "mixed" in config.mixes:
        chat_data = build_dataset(config.fit_config("mixed"), log)
        log(f"encoding {len(chat_data.train)} ShareGPT and trace training examples for the mixed heads")
        chat = (encode(encoder, chat_data.train), lengths(chat_data.train))
    scores = {}
    for mix in config.mixes:
        for kind in config.heads:
            log(f"{kind}/{mix}: {config.folds}-fold cross-validation over {len(data.train)} training turns")
            predicted = np.zeros(len(y))
            for k in range(config.folds):
                inside = fold != k
                predicted[~inside] = _fit(kind, mix, x[inside], y[inside], chat, config).predict(x[~inside])
            scores[f"{kind}/{mix}"] = metrics.report(predicted, y)
            log(f"{kind}/{mix}: out of fold {_line(scores[f'{kind}/{mix}'])}")
    best = max(scores, key=lambda k: (scores[k]["kendall_tau"], -scores[k]["mae_tokens"]))
    kind, mix = best.split("/")
    log(f"refitting {best} on all {len(data.train)} training turns")
    head = _fit(kind, mix, x, y, chat, config)
    head = Head(head.kind, head.mean, head.scale, head.weights, head.biases, head.bin_lengths,
                {**head.meta, "data": AGENT_TEXT, "mix": mix, "agent_train": asdict(config),
                 "cross_validation": scores})
    path = head.save(out)
    report = {"head": os.path.basename(path), "data": AGENT_TEXT, "chosen": best, "cross_validation": scores,
              "folds": config.folds, "train_examples": len(data.train), "held_out_examples": len(data.test),
              "train_sessions": sorted({e.group for e in data.train}),
              "held_out_sessions": sorted({e.group for e in data.test}),
              "parameters": head.parameters, "seconds": round(time.perf_counter() - started, 1),
              "config": asdict(config)}
    with open(os.path.join(out, REPORT_FILE), "w") as handle:
        json.dump(report, handle, indent=2)
    log(f"kept {best} ({head.parameters} parameters): {path}")
    return report


def config_of(head: Head) -> AgentTrainConfig:
    """The agent config a head was trained with (the defaults for a head not trained on agent turns)."""
    saved = head.meta.get("agent_train", {})
    return AgentTrainConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()})


def _max_tokens(_: Sequence[Example]) -> Callable[[Sequence[Example]], np.ndarray]:
    return lambda test: np.full(len(test), float(MAX_TOKENS))


AGENT_BASELINES = {"type-mean": BASELINES["type-mean"], "global-mean": BASELINES["global-mean"],
                   "max_tokens": _max_tokens}


def evaluate_agent(heads: dict[str, str], config: AgentTrainConfig | None = None,
                   log: Callable[[str], None] = lambda _: None, turn_chars: int = 0,
                   reply_chars: int | None = None) -> dict:
    """Each named head directory and the baselines on the held-out agent sessions, overall and per family.

    `config` names the split (None: the first head's, `config_of`). `turn_chars` > 0: the turns as
    `marsched loadgen --turn-chars` (and `--reply-chars`) replays them, the baselines fitted on the cut
    training turns.
    """
    loaded = {name: load_head(directory) for name, directory in heads.items()}
    config = config or config_of(next(iter(loaded.values())))
    data = agent_dataset(config, log, turn_chars, reply_chars)
    predictions = {}
    for name, head in loaded.items():
        encoder = Encoder(head.meta.get("encoder", "embed"), head.meta.get("max_tokens", 128),
                          bool(head.meta.get("previous_feature", False)))
        log(f"{name}: encoding {len(data.test)} held-out turns")
        predictions[name] = head.predict(encode(encoder, data.test))
    predictions.update({name: fit(data.train)(data.test) for name, fit in AGENT_BASELINES.items()})
    y = lengths(data.test)
    families = sorted({e.source for e in data.test})
    result: dict = {"data": AGENT_TEXT, "heads": {name: str(d) for name, d in heads.items()},
                    "split": {"seed": config.seed, "held_out": config.held_out,
                              "held_out_sessions": sorted({e.group for e in data.test})},
                    "held_out_examples": len(data.test), "train_examples": len(data.train), "turn_chars": turn_chars,
                    "reply_chars": reply_chars,
                    "max_tokens": MAX_TOKENS, "all": {}, "by_source": {}}
    for name, predicted in predictions.items():
        result["all"][name] = metrics.report(predicted, y)
        for family in families:
            mask = np.array([e.source == family for e in data.test])
            result["by_source"].setdefault(family, {})[name] = metrics.report(predicted[mask], y[mask])
    return result


def _line(report: dict) -> str:
    return (f"Acc-5 {report['acc5']:.3f}  Acc-15 {report['acc15']:.3f}  MAE {report['mae_tokens']:.1f}  "
            f"tau {report['kendall_tau']:.3f}  (n={report['n']})")

"""What online calibration buys a learned head on agent text from a family it never trained on.

``python -m marsched.experiments.predictor_calibration --out FILE`` (the predict extra).

For each family of the bundled agent-text sessions (``miniswe``, ``magagent``;
`marsched.predict.agent_examples`), hold it out: train a head on the *other* family alone
(`agent_train.train_agent`, the packaged agent head's recipe without the ShareGPT mix, its
candidates cross-validated over the training family's sessions), then replay the held-out
family's sessions as a server would see them: one session after the other, in the file's order,
each turn predicted from the past only (`CalibratedLength.predict_past`) and then observed
(`observe_output`). Each session is one request (`task_class` ``agent``: a server does not know
the family), its turns the segments.

Predictors compared on every turn of the held-out family:

- ``online``: `OnlineLength`, no text;
- per head (``holdout``, the head trained on the other family; ``default``, the packaged
  head, trained on ShareGPT and the INFERCEPT chat records, which never saw agent text) and
  per scale (1, 30 and 1/30: the head off by 30× either way):
  ``<head>x<scale>/raw`` (the head's estimate as it is) and ``<head>x<scale>/calibrated``
  (`CalibratedLength`);
- at scale 1, two ablations of the factor: ``class-only`` (the request's own ratios ignored)
  and ``request-only`` (the class's factor ignored).

Metrics (`marsched.predict.metrics`): Kendall's tau-b and MAE in tokens, with Acc-5/Acc-15,
over all turns, and over the turns after the first three sessions (once the class factor has
seen some replies).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict

import numpy as np

from marsched.predict import metrics
from marsched.predict.calibrated import CLASS_WEIGHT, MAX_FACTOR, PRIOR_WEIGHT, CalibratedLength
from marsched.predict.online import OnlineLength
from marsched.workload.model import ApiCall, ApiType, Segment
from marsched.workload.past import RequestPast

TASK_CLASS = "agent"
SCALES = (1.0, 30.0, 1.0 / 30.0)
WARM_SESSIONS = 3  # the "warm" metrics leave out the turns of the first sessions replayed

# A session: its key and its turns, each (context tokens at the turn, reply tokens).
Session = tuple[str, Sequence[tuple[int, int]]]


def replay(sessions: Sequence[Session], predictor) -> np.ndarray:
    """Each turn's prediction, sessions one after the other, from the past only; then observed."""
    predicted = []
    for key, turns in sessions:
        done: list[Segment] = []
        prompt = turns[0][0] if turns else 0
        for context, reply in turns:
            past = RequestPast(key, TASK_CLASS, prompt, context, tuple(done))
            predicted.append(predictor.predict_past(past))
            predictor.observe_output(past, reply)
            done.append(Segment(context, reply, ApiCall(ApiType.TOOL, 0.0, 0)))
    return np.asarray(predicted, dtype=np.float64)


def true_lengths(sessions: Sequence[Session]) -> np.ndarray:
    return np.asarray([reply for _, turns in sessions for _, reply in turns], dtype=np.float64)


def table_of(sessions: Sequence[Session], estimates: Sequence[float], scale: float = 1.0) -> dict[str, list[float]]:
    """Session key -> the head's estimate per turn (in replay order), times `scale`."""
    values = iter(estimates)
    return {key: [max(1.0, float(next(values)) * scale) for _ in turns] for key, turns in sessions}


class _Raw:
    """The head's estimate as it is (a fixed table), for the same replay."""

    def __init__(self, table: dict[str, list[float]]):
        self.table = table

    def predict_past(self, past: RequestPast) -> int:
        return max(1, round(self.table[past.request_id][past.segment_index]))

    def observe_output(self, past: RequestPast, tokens: int) -> None:
        pass


def scores(predicted: np.ndarray, true: np.ndarray, warm_from: int) -> dict:
    """The metrics over all turns and over the turns from index `warm_from` on."""
    out = {"all": metrics.report(predicted, true)}
    if 1 < len(true) - warm_from:
        out["warm"] = metrics.report(predicted[warm_from:], true[warm_from:])
    return out


def compare(sessions: Sequence[Session], heads: dict[str, Sequence[float]],
            scales: Sequence[float] = SCALES) -> dict[str, dict]:
    """Every predictor of the module docstring on `sessions`, given each head's estimates per turn."""
    true = true_lengths(sessions)
    warm_from = sum(len(turns) for _, turns in sessions[:WARM_SESSIONS])
    predictors: dict[str, Callable[[], object]] = {"online": OnlineLength}
    for head, estimates in heads.items():
        for scale in scales:
            table = table_of(sessions, estimates, scale)
            label = f"{head}x{_scale_name(scale)}"
            predictors[f"{label}/raw"] = lambda table=table: _Raw(table)
            predictors[f"{label}/calibrated"] = lambda table=table: CalibratedLength(table=table)
            if scale == 1.0:
                predictors[f"{label}/class-only"] = lambda table=table: CalibratedLength(table=table, class_weight=1e9)
                predictors[f"{label}/request-only"] = lambda table=table: CalibratedLength(table=table, class_weight=0.0)
    return {name: scores(replay(sessions, make()), true, warm_from) for name, make in predictors.items()}


def _scale_name(scale: float) -> str:
    return f"{scale:g}" if scale >= 1 else f"1/{1 / scale:g}"


def _sessions(examples) -> list[Session]:
    sessions: dict[str, list[tuple[int, int]]] = {}
    for example in examples:  # in file order, a session's turns in order (`agent_examples`)
        sessions.setdefault(example.group, []).append((example.context_tokens, example.output_tokens))
    return list(sessions.items())


def run(heads_dir: str, seed: int = 0, log: Callable[[str], None] = print) -> dict:
    from marsched.predict.agent_examples import FAMILIES, agent_examples
    from marsched.predict.agent_train import AgentDataset, AgentTrainConfig, train_agent
    from marsched.predict.encoder import Encoder
    from marsched.predict.head import load_head
    from marsched.predict.learned import default_head_dir
    from marsched.predict.train import encode

    def estimates(directory: str, examples) -> list[float]:
        head = load_head(directory)
        encoder = Encoder(head.meta.get("encoder", "embed"), int(head.meta.get("max_tokens", 128)),
                          bool(head.meta.get("previous_feature", False)))
        return np.rint(head.predict(encode(encoder, examples))).tolist()

    started = time.perf_counter()
    log("reading the agent-text sessions")
    examples = agent_examples()
    config = AgentTrainConfig(seed=seed, mixes=("alone",))
    result: dict = {"data": "agent-text", "seed": seed, "task_class": TASK_CLASS, "warm_sessions": WARM_SESSIONS,
                    "scales": list(SCALES), "train_config": asdict(config),
                    "calibration": {"max_factor": MAX_FACTOR, "prior_weight": PRIOR_WEIGHT, "class_weight": CLASS_WEIGHT},
                    "held_out": {}}
    for held in FAMILIES:
        train = [e for e in examples if e.source != held]
        test = [e for e in examples if e.source == held]
        directory = os.path.join(heads_dir, f"without-{held}")
        log(f"held out {held}: training a head on {len(train)} turns of {sorted({e.source for e in train})}")
        report = train_agent(directory, config, log, AgentDataset(train, test))
        sessions = _sessions(test)
        heads = {"holdout": estimates(directory, test), "default": estimates(default_head_dir(), test)}
        log(f"held out {held}: replaying {len(sessions)} sessions, {len(test)} turns")
        result["held_out"][held] = {
            "trained_on": sorted({e.source for e in train}), "train_turns": len(train),
            "head_chosen": report["chosen"], "sessions": len(sessions), "turns": len(test),
            "median_reply_tokens": float(np.median(true_lengths(sessions))),
            "median_estimate": {name: float(np.median(v)) for name, v in heads.items()},
            "predictors": compare(sessions, heads),
        }
    result["seconds"] = round(time.perf_counter() - started, 1)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="the JSON report")
    parser.add_argument("--heads-dir", default=None, help="where the held-out heads are saved (default: a temporary folder)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        result = run(args.heads_dir or scratch, args.seed, lambda line: print(line, file=sys.stderr, flush=True))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as handle:
        json.dump(result, handle, indent=2)
    for held, part in result["held_out"].items():
        print(f"held out {held} ({part['turns']} turns, median reply {part['median_reply_tokens']:g}; head trained on "
              f"{', '.join(part['trained_on'])}):")
        for name, score in part["predictors"].items():
            a = score["all"]
            print(f"  {name:28s} tau {a['kendall_tau']:6.3f}  MAE {a['mae_tokens']:9.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

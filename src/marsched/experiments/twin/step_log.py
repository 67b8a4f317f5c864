"""A live server's step log, priced by the step costs the twin could simulate it at.

Bench's step-timed schedulers (`marsched.bench.steps`: `StepTimedScheduler` is vLLM's own) write
one line per step to the file named by `MARSCHED_STEP_LOG`. This sets the measured step times
against three sets of terms:

- `profile`: a profile's (`marsched calibrate`), the engine timed alone;
- `latest`: the fit a server decides with (`policy.learned_cost`, forgetting all but about its
  last 4,096 steps), fed the log's steps in order from a server's placeholders, as it ends;
- `whole run`: the same fit forgetting nothing (`LearnedCost.run_terms`), what the twin simulates at.

Per kind of step (decode only; chunks of under 256, 256 to 2,047, and 2,048 or more new tokens),
the steps, the measured seconds and each set's priced seconds over the measured:

    python -m marsched.experiments.twin.step_log STEPS.jsonl --profile PROFILE.json

docs/twin.md ("The servers' step costs") has the run it explained.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from marsched.policy.cost_model import CostModel
from marsched.experiments.twin.served_costs import with_served_terms
from marsched.policy.learned_cost import CostSource, LearnedCost, StepShape
from marsched.sim.profile import load_profile
from marsched.vllm.config import MarsConfig

FIELDS = ("step_s", "tokens", "seqs", "ctx", "pairs")  # bench/steps.py's names
KINDS = ("decode", "chunk < 256", "chunk 256-2047", "chunk >= 2048")
TERM_SETS = ("profile", "latest", "whole run")


@dataclass(frozen=True, slots=True)
class LoggedStep:
    shape: StepShape
    seconds: float


def step_kind(tokens: int, sequences: int) -> str:
    """A step's kind: decode only (one token a sequence), else by its new tokens."""
    if tokens == sequences:
        return KINDS[0]
    return KINDS[1] if tokens < 256 else KINDS[2] if tokens < 2048 else KINDS[3]


def read_steps(path: Path) -> list[LoggedStep]:
    """The log's steps that computed something; ValueError naming the file, line and field of a bad one.
    A last line cut short (an engine killed while writing) is skipped."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as error:
        raise ValueError(f"{path}: cannot read the step log ({error.strerror or error})") from None
    steps = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                continue
            raise ValueError(f"{path}:{number}: not a JSON object") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{number}: not a JSON object")
        for name in FIELDS:
            value = row.get(name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"{path}:{number}: field {name!r} must be a number >= 0, got {value!r}")
        if row["tokens"] == 0:  # a step that computed nothing
            continue
        if row["step_s"] <= 0:
            raise ValueError(f"{path}:{number}: field 'step_s' must be > 0 for a step that computed tokens")
        steps.append(LoggedStep(StepShape(int(row["tokens"]), int(row["ctx"]), int(row["seqs"]), int(row["pairs"])),
                                float(row["step_s"])))
    if not steps:
        raise ValueError(f"{path}: no step that computed tokens")
    return steps


def fitted_terms(steps: list[LoggedStep], token_budget: int) -> dict[str, CostModel]:
    """The latest and the whole run's fits of a server fed `steps` in order."""
    learned = LearnedCost(MarsConfig().cost_model(token_budget), CostSource.PLACEHOLDER, CostSource.PLACEHOLDER)
    for step in steps:
        learned.observe_step(step.shape, step.seconds)
    run = learned.run_terms()
    if run is None:
        raise ValueError(f"{len(steps)} steps: too few to fit (a server fits after {learned.step.settings.min_steps})")
    return {"latest": learned.cost, "whole run": with_served_terms(learned.cost, run)}


@dataclass
class KindTotals:
    kind: str
    steps: int = 0
    measured_s: float = 0.0
    priced_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(TERM_SETS, 0.0))


def priced(steps: list[LoggedStep], costs: dict[str, CostModel]) -> list[KindTotals]:
    """Per kind and in all (`all`, last): the steps, their measured seconds and each cost model's."""
    totals = {kind: KindTotals(kind) for kind in (*KINDS, "all")}
    for step in steps:
        s = step.shape
        for kind in (step_kind(s.tokens, s.sequences), "all"):
            row = totals[kind]
            row.steps += 1
            row.measured_s += step.seconds
            for name, cost in costs.items():
                row.priced_s[name] += cost.iteration_time(s.tokens, s.context_tokens, s.sequences, s.attention_pairs)
    return [row for row in totals.values() if row.steps]


def markdown(rows: list[KindTotals]) -> str:
    head = "| steps | count | measured s | " + " | ".join(f"{name} s (÷ measured)" for name in TERM_SETS) + " |"
    lines = [head, "| --- " * (3 + len(TERM_SETS)) + "|"]
    for row in rows:
        cells = " | ".join(f"{row.priced_s[name]:.1f} ({row.priced_s[name] / row.measured_s:.2f})" for name in TERM_SETS)
        lines.append(f"| {row.kind} | {row.steps} | {row.measured_s:.1f} | {cells} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m marsched.experiments.twin.step_log", description=__doc__.split("\n\n")[0])
    p.add_argument("log", help="the step log (JSON lines, MARSCHED_STEP_LOG)")
    p.add_argument("--profile", required=True, help="the engine's profile (`marsched calibrate --out`) or a bundled name")
    p.add_argument("--token-budget", type=int, default=4096, help="the server's --max-num-batched-tokens")
    args = p.parse_args(argv)
    if args.token_budget < 1:
        print(f"step_log: --token-budget {args.token_budget}: give a number >= 1", file=sys.stderr)
        return 2
    try:
        steps = read_steps(Path(args.log))
        profile = load_profile(args.profile).cost
        costs: dict[str, Any] = {"profile": profile, **fitted_terms(steps, args.token_budget)}
    except (ValueError, OSError) as error:
        print(f"step_log: {error}", file=sys.stderr)
        return 2
    print(markdown(priced(steps, costs)), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())

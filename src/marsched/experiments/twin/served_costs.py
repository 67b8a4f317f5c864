"""The step costs the live servers measured, for simulating beside the profile's.

`marsched calibrate` times an engine alone in one process: no API server, no worker process, no
bench logits processor. A live server steps slower: its scheduler talks to a worker process every
step, the reply-length processor edits every row's logits, and the API server and the load
generator share the machine. How much slower depends on the load (the front end's work grows with
the request rate), so no in-process measurement can stand for it.

Every marsched server learns the cost model's five step terms from its own steps, over the same
span `calibrate` times (`policy/learned_cost.py`; `/marsched/state` `cost_model`), and its swap rate
from its copies. The twin takes the fit over the whole run (`cost_model.run`): the fit a server
decides with forgets all but its last few thousand steps, the drain's mix at a queueing load. The
policies' own work per step differs too (INFERCEPT's servers learned twice MARS's time per
sequence), so at each load the twin simulates every configuration again at the median of each term
over that configuration's own runs (docs/twin.md, "The servers' step costs").
These are engine constants read from step times, not the latencies being predicted. Stock vLLM's
servers run vLLM's scheduler with a step meter beside it (`vllm/step_meter.py`), which fits the same
terms the same way. Runs from before the meter have none; their configurations are simulated at the
terms of the marsched server closest to them, `--policy vllm` (vLLM's order, the plugin's bookkeeping),
or, where the load ran none, at the median over every run of the load that learned them.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

from marsched.policy.cost_model import CostModel, attention_pairs
from marsched.policy.learned_cost import STEP_TERM_NAMES, CostSource, StepShape

LEARNED = CostSource.LEARNED.value  # a term's source in a server's cost model (`LearnedCost.snapshot`)
SWAP_TERM = "swap_tokens_per_s"
# Stock configurations, and the marsched configuration whose terms stand in for theirs where a run has no
# step meter's (runs from before it).
STAND_IN = {"vllm-stock": "vllm", "vllm-stock-host": "vllm"}

# Steps of the kinds the twin's servers run (a chunk within the 4,096-token budget, decode batches of
# one and eight at the contexts its tasks reach), at which the servers' step time is set against the
# profile's.
REFERENCE_STEPS = (
    StepShape(tokens=1024, context_tokens=1024, sequences=1, attention_pairs=attention_pairs(1024, 0)),
    StepShape(tokens=4096, context_tokens=4096, sequences=1, attention_pairs=attention_pairs(4096, 0)),
    StepShape(tokens=1, context_tokens=4096, sequences=1, attention_pairs=attention_pairs(1, 4095)),
    StepShape(tokens=8, context_tokens=8 * 4096, sequences=8, attention_pairs=8 * attention_pairs(1, 4095)),
)


def run_step_terms(cost_model: dict[str, Any]) -> dict[str, Any]:
    """A server's step terms for the twin: its whole run's fit (`run`, `LearnedCost.run_terms`) where
    it reported one, else (a run from before it) the terms it decided with last."""
    run = cost_model.get("run")
    return run if isinstance(run, dict) else cost_model


def served_terms(cost_models: Iterable[dict[str, Any] | None]) -> dict[str, Any] | None:
    """The median of each learned term (`run_step_terms`) over the runs' cost models (`RunRecord.cost_model`),
    with how many runs gave them and how many of those fitted their whole run; None when no run learned
    its step terms."""
    learned = [c for c in cost_models if isinstance(c, dict) and c.get("step_source") == LEARNED]
    if not learned:
        return None
    steps = [run_step_terms(c) for c in learned]
    terms: dict[str, Any] = {name: statistics.median(float(c[name]) for c in steps) for name in STEP_TERM_NAMES}
    swaps = [float(c[SWAP_TERM]) for c in learned if c.get("swap_source") == LEARNED]
    if swaps:
        terms[SWAP_TERM] = statistics.median(swaps)
    terms["runs"] = len(learned)
    terms["whole_run_fits"] = sum(isinstance(c.get("run"), dict) for c in learned)
    terms["swap_runs"] = len(swaps)
    return terms


def costs_by_config(runs: Iterable[tuple[str, dict[str, Any] | None]],
                    configs: Iterable[str]) -> dict[str, dict[str, Any]] | None:
    """Per configuration, `served_terms` of its own runs' cost models (`runs`: (configuration, cost model)),
    with `from_runs_of` naming whose runs gave them: its own; else its `STAND_IN`'s; else every run
    that learned them (`all`). None when no run learned its step terms."""
    runs = list(runs)
    pooled = served_terms(cost for _, cost in runs)
    if pooled is None:
        return None

    def of(config: str) -> dict[str, Any] | None:
        return served_terms(cost for name, cost in runs if name == config)

    costs = {}
    for config in configs:
        sources = [config] + ([STAND_IN[config]] if config in STAND_IN else [])
        source, terms = next(((name, terms) for name in sources if (terms := of(name)) is not None), ("all", pooled))
        costs[config] = terms | {"from_runs_of": source}
    return costs


def with_served_terms(cost: CostModel, terms: dict[str, Any]) -> CostModel:
    """`cost` with the servers' step terms, and their swap rate where they learned one; its token
    budget stays (the servers run the same one)."""
    values = {name: terms[name] for name in STEP_TERM_NAMES}
    if SWAP_TERM in terms:
        values[SWAP_TERM] = terms[SWAP_TERM]
    return replace(cost, **values)


def step_time_ratio(profile: CostModel, served: CostModel) -> float:
    """The servers' step time over the profile's, the median over `REFERENCE_STEPS`."""
    def time(cost: CostModel, step: StepShape) -> float:
        return cost.iteration_time(step.tokens, step.context_tokens, step.sequences, step.attention_pairs)

    return statistics.median(time(served, step) / time(profile, step) for step in REFERENCE_STEPS)

"""The named policies (docs/policies.md, "The policies")."""

from __future__ import annotations

import math
from dataclasses import replace

from marsched.policy.admission import Admission
from marsched.policy.cost_model import CostModel
from marsched.policy.boost import DEFAULT_BOOST_GAMMA
from marsched.policy.nudge import DEFAULT_NUDGE_M
from marsched.policy.program_rest import RestRule
from marsched.policy.policy import (
    Order, Policy, Protection, StarvationClock, StarvationConfig, StarvationCount, StrategyRule,
)
from marsched.policy.plas import STARVATION_RATIO
from marsched.policy.ranking import RankingTerms
from marsched.policy.size_labels import SizeLabels
from marsched.policy.strategy import Strategy
from marsched.policy.ttl import FixedTtl, PaperTtl
from marsched.predict.segment import SegmentPredictor

# name -> (order, rule, fixed strategy, MARS's defaults: starvation prevention and predicted-peak admission)
_NAMED: dict[str, tuple[Order, StrategyRule, Strategy | None, bool]] = {
    "vllm": (Order.FCFS_REENTRY, StrategyRule.END_AT_CALL, None, False),
    "vllm-v0": (Order.FCFS_REENTRY, StrategyRule.END_AT_CALL, None, False),
    # Stock vLLM V1 with CPU offloading (--kv-offloading-size) of the host memory Swap gets.
    "vllm-offload": (Order.FCFS_REENTRY, StrategyRule.END_AT_CALL, None, False),
    "infercept": (Order.FCFS, StrategyRule.AT_CALL, None, False),
    "infercept-code": (Order.FCFS, StrategyRule.BUDGETED, None, False),
    "sjf": (Order.REMAINING_TOKENS, StrategyRule.AHEAD, None, False),
    "preserve": (Order.FCFS, StrategyRule.FIXED, Strategy.PRESERVE, False),
    "discard": (Order.FCFS, StrategyRule.FIXED, Strategy.DISCARD, False),
    "swap": (Order.FCFS, StrategyRule.FIXED, Strategy.SWAP, False),
    "mars": (Order.MEMORY_TIME, StrategyRule.AHEAD, None, True),
    # MARS with γ-Boost for the order (`boost.py`): overtaking bounded, no promotions needed.
    "mars-boost": (Order.BOOST, StrategyRule.AHEAD, None, True),
    # The same with Boost's form for predicted sizes (`size_labels.py`): a size is worth what the
    # predictions with its label turned out to be.
    "mars-boost-label": (Order.BOOST, StrategyRule.AHEAD, None, True),
    # MARS with Nudge-M for the order (`nudge.py`): first come first served, a small arrival may
    # swap with a large request among the last M waiting, each large one at most once.
    "mars-nudge": (Order.NUDGE, StrategyRule.AHEAD, None, True),
    # Continuum (arXiv 2511.02230): program-level FCFS (a request's calls keep its arrival), a pin
    # for a time-to-live after each call (`ttl.py`), pins given up under memory pressure.
    "continuum": (Order.FCFS, StrategyRule.TTL, None, False),
    "continuum-public": (Order.FCFS, StrategyRule.TTL, None, False),
    # Autellix (arXiv 2502.13965): PLAS order, each call a request of its own (it leaves at the
    # call and comes back as a new one, which the prefix cache serves), its anti-starvation rule.
    "autellix": (Order.LEAST_ATTAINED, StrategyRule.END_AT_CALL, None, False),
}
# Policies whose starvation rule is not MARS's and not off by default.
# Boost and Nudge bound how far a request is passed themselves: no promotions.
_OWN_STARVATION = {"autellix": "autellix", "mars-boost": "off", "mars-boost-label": "off", "mars-nudge": "off"}
# The TTL each Continuum variant pins for: the paper's rule, or the authors' public 2 s rule.
_TTL_RULES = {
    "continuum": lambda cost: PaperTtl(cost.recompute_time),
    "continuum-public": lambda cost: FixedTtl(),
}

POLICY_NAMES: tuple[str, ...] = tuple(_NAMED)
# Policies that model an engine without a prefix cache, whatever the run asks: vLLM 0.2 (the
# paper's stock vLLM) and INFERCEPT's published code (a fork of vLLM 0.2).
NO_PREFIX_CACHE: frozenset[str] = frozenset({"vllm-v0", "infercept-code"})
# Policies only the simulator runs, with what to run on vLLM instead (None: nothing alike there).
# INFERCEPT's code moves parts of a request's KV, which vLLM's KV manager does not; vLLM 0.2 is
# not the vLLM the plugin runs in; vLLM's CPU offloading and Continuum's TTL pins are modelled
# here only. (autellix, mars-boost, mars-boost-label and mars-nudge run on vLLM too: a program's
# attained service, first arrival and Nudge place are kept across its turns there, `vllm/programs.py`.)
_ON_VLLM_INSTEAD: dict[str, str | None] = {
    "infercept-code": "infercept", "vllm-v0": "vllm", "vllm-offload": "vllm",
    "continuum": None, "continuum-public": None,
}
SIMULATOR_ONLY: frozenset[str] = frozenset(_ON_VLLM_INSTEAD)


def simulator_only_reason(name: str) -> str:
    """Why simulator-only policy `name` is refused on vLLM, and what to use there instead."""
    instead = _ON_VLLM_INSTEAD[name]
    return "runs only in the simulator (marsched simulate/compare)" + (f"; on vLLM use {instead}" if instead else "")

# Starvation prevention variants; `fcfs-wait` is MARS's default here (docs/policies.md, "What MARS does").
STARVATION_VARIANTS: dict[str, StarvationConfig] = {
    # Promoted once it has waited twice what first come first served would make a request
    # arriving now wait (at least 1 s); then as `age`. `fcfs-wait:K` sets the multiple.
    "fcfs-wait": StarvationConfig(1.0, 0, StarvationClock.SECONDS, StarvationCount.ALL_WAITING, Protection.SEGMENT,
                                  for_life=True, fcfs_multiple=2.0),
    # Waited 15 s in total (across calls and preemptions): promoted for the rest of its life;
    # promoted requests go first come first served, each protected until its segment ends.
    "age": StarvationConfig(15.0, 0, StarvationClock.SECONDS, StarvationCount.ALL_WAITING, Protection.SEGMENT,
                            for_life=True),
    # The MARS code's mechanism (mars-codebase, scheduler_v2.py): 100 iterations, counted only for
    # requests that ran before, protected for 100,000 iterations.
    "published": StarvationConfig(100, 100_000, counts=StarvationCount.REQUEUED),
    # The same counter for every waiting request (the first marsched release's default).
    "iterations": StarvationConfig(100, 100_000),
    # Autellix's (arXiv 2502.13965, Alg. 1 lines 24-30): a call whose waiting reaches 8 times its
    # program's attained service (in iterations, at least 1) goes ahead; its counter starts again;
    # no protection. (The paper counts the program's earlier waits and service and resets only
    # the call's; here both count across the whole program and reset together.)
    "autellix": StarvationConfig(STARVATION_RATIO, 0, StarvationClock.ITERATIONS, StarvationCount.ALL_WAITING, Protection.QUANTUM,
                                 per_service=True),
    "off": StarvationConfig(None),
}
DEFAULT_STARVATION = "fcfs-wait"


def named_rules(name: str) -> tuple[Order, StrategyRule, Strategy | None]:
    """A named policy's queue order, strategy rule and fixed strategy (what an audit checks)."""
    if name not in _NAMED:
        raise ValueError(f"unknown policy {name!r}; valid: {', '.join(POLICY_NAMES)}")
    return _NAMED[name][:3]


def starvation_variant(config: StarvationConfig) -> str:
    """The named variant a starvation rule comes from (its threshold aside), or "custom"."""
    def rules(c: StarvationConfig) -> tuple:  # everything but the threshold (a replace() could be invalid)
        return (c.quantum, c.clock, c.counts, c.protection, c.for_life, c.threshold is None, c.fcfs_multiple is None,
                c.per_service)

    for name, variant in STARVATION_VARIANTS.items():
        if rules(variant) == rules(config):
            return name
    return "custom"
STARVATION_NAMES: tuple[str, ...] = tuple(STARVATION_VARIANTS)

_DEFAULT = object()


def make_policy(
    name: str,
    cost: CostModel,
    predictor: SegmentPredictor | None = None,
    starvation_threshold: float | None | object = _DEFAULT,
    starvation_quantum: int | object = _DEFAULT,
    refresh_interval: int = 1,
    terms: RankingTerms | None = None,
    starvation: str | object = _DEFAULT,
    admission: Admission | str | object = _DEFAULT,
    prefix_cache: bool = False,
    rest: RestRule | str = RestRule.PLAN,
    boost_gamma: float = DEFAULT_BOOST_GAMMA,
    nudge_m: int = DEFAULT_NUDGE_M,
) -> Policy:
    """Build a named policy.

    `starvation` picks a variant of `STARVATION_VARIANTS` (MARS's default `age`; the
    others' default `off`); `starvation_threshold` overrides its threshold, in its clock's
    units, and `None` turns prevention off. `admission` defaults to predicted-peak for MARS
    and greedy for the others. `prefix_cache`: the engine keeps freed blocks' content (vLLM V1);
    the policies in `NO_PREFIX_CACHE` model an engine that does not, and ignore it.
    """
    if name not in _NAMED:
        raise ValueError(f"unknown policy {name!r}; valid: {', '.join(POLICY_NAMES)}")
    order, rule, fixed, mars_defaults = _NAMED[name]
    if starvation is _DEFAULT:
        if name in _OWN_STARVATION:
            starvation = _OWN_STARVATION[name]
        elif mars_defaults:
            starvation = DEFAULT_STARVATION
        else:  # off, unless a threshold asks for it: then counted in iterations
            starvation = "iterations" if starvation_threshold not in (_DEFAULT, None) else "off"
    config = starvation_config(starvation)
    if starvation_threshold is not _DEFAULT:
        if starvation_threshold is not None and config.threshold is None:
            raise ValueError(f"starvation threshold {starvation_threshold:g} given with starvation 'off': "
                             "drop the threshold or choose a variant (age, published, iterations)")
        config = replace(config, threshold=starvation_threshold)
    if starvation_quantum is not _DEFAULT:
        config = replace(config, quantum=starvation_quantum)
    if admission is _DEFAULT:
        admission = Admission.PREDICTED_PEAK if mars_defaults else Admission.GREEDY
    try:
        admission = Admission(admission)
    except ValueError:
        valid = ", ".join(a.value for a in Admission)
        raise ValueError(f"unknown admission rule {admission!r}; valid: {valid}") from None
    if rule is StrategyRule.BUDGETED and (admission is not Admission.GREEDY or config.enabled):
        raise ValueError(f"policy {name!r} schedules as INFERCEPT's code does: greedy admission and no "
                         "starvation prevention; drop --admission and --starvation")
    return Policy(
        name=name,
        order=order,
        rule=rule,
        cost=cost,
        predictor=predictor or SegmentPredictor.oracle(),
        fixed_strategy=fixed,
        starvation=config,
        refresh_interval=refresh_interval,
        terms=terms or RankingTerms(),
        admission=admission,
        prefix_cache=prefix_cache and name not in NO_PREFIX_CACHE,
        offload=name == "vllm-offload" and prefix_cache,
        ttl=_TTL_RULES[name](cost) if name in _TTL_RULES else None,
        rest=parse_rest(rest),
        boost_gamma=boost_gamma if order is Order.BOOST else None,
        nudge_m=nudge_m if order is Order.NUDGE else None,
        size_labels=SizeLabels() if name == "mars-boost-label" else None,
    )


def parse_rest(rest: RestRule | str) -> RestRule:
    """A `RestRule` from its name (plan, mean, gittins)."""
    try:
        return RestRule(rest)
    except ValueError:
        raise ValueError(f"unknown rest rule {rest!r}; valid: {', '.join(r.value for r in RestRule)}") from None


def starvation_config(name: str) -> StarvationConfig:
    """A named variant's rule; `fcfs-wait:K` is `fcfs-wait` with the multiple K."""
    base, _, multiple = name.partition(":")
    if base not in STARVATION_VARIANTS:
        raise ValueError(f"unknown starvation variant {name!r}; valid: {', '.join(STARVATION_NAMES)}")
    config = STARVATION_VARIANTS[base]
    if not multiple:
        return config
    if config.fcfs_multiple is None:
        raise ValueError(f"starvation variant {name!r}: only fcfs-wait takes a multiple (fcfs-wait:K)")
    try:
        value = float(multiple)
    except ValueError:
        raise ValueError(f"starvation variant {name!r}: the multiple after ':' must be a number") from None
    return replace(config, fcfs_multiple=value)  # validated there


def parse_threshold(text: str) -> float | None:
    """`off` or a positive number (iterations or seconds, as the starvation variant counts)."""
    if text.strip().lower() in ("off", "none"):
        return None
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"starvation threshold {text!r}: give a positive number or 'off'") from None
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"starvation threshold {text!r}: give a positive number or 'off'")
    return value


"""A cost model learned online from the engine's own steps and copies.

A server that was given no profile ranks with placeholder constants. This fits the same
iteration-time form that `marsched calibrate` fits (`bench/fit.py`), term by term,

    t = c + a·tokens + b·context_tokens + d·sequences + e·attention_pairs,

from each step's measured duration and shape, and the host link's rate from the measured copies,
so that the ranking and the strategy choice use this engine's costs from its first steps on.

The fit (`StepTimeFit`):

- relative least squares, as calibrate's: each step weighs `1/t²`, so a 3 ms decode step counts as
  much as a 300 ms prefill, and a step slowed tenfold by something else (a warm-up, a neighbour's
  job) moves the fit by a bounded relative residual (below 1), not by its size;
- sufficient statistics only (a 5×5 matrix and a vector), forgotten at `1/memory_steps` per step,
  so the estimate follows an engine whose speed drifts and costs O(1) memory;
- beside it, the same fit over the whole run, forgetting nothing (`LearnedCost.run`), reported and
  never decided with: what the run's steps cost, for a simulator to replay the run at. A fit that
  forgets weighs the last few thousand steps, and where a run ends in a different mix (the drain of
  a queueing load: small steps on long contexts) it extrapolates that mix to every step. This one
  weighs each step by its time (`StepWeight.TIME`), not alike: where the form cannot fit every kind
  of step, the steps that hold the run's time set the terms, not the many short ones (a run of
  decode steps with a few long chunks had the chunks priced 1.17× their time; docs/twin.md, "The
  servers' step costs");
- a Gaussian prior at the starting constants (the placeholders), weighing `prior_steps` steps in
  each term's own scale (moving a term by as much as explains an average step costs as much as
  `prior_steps` steps off by 100%): where the traffic does not separate two terms (`a` beside `d`
  while every step decodes) the data moves them together and the prior holds their difference,
  so early estimates do not swing;
- non-negative: every constant is a cost (exact, over the subsets of terms, as `bench/fit.py`);
- it replaces the prior only after `min_steps` steps; refitted every `refit_every` steps.

The swap rate (`SwapRateFit`) is the tokens copied over the seconds the copies took, both ways,
once `min_swap_blocks` blocks have been copied.

Pure: numbers in, numbers out; the vLLM plugin feeds it (`vllm/step_clock.py`).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace
from enum import Enum

import numpy as np

from marsched.policy.cost_model import CostModel

TERMS = ("c", "a", "b", "d", "e")  # bench/fit.py's names: fixed, per token, per context token, per sequence, per pair
# The same terms as `snapshot` names them (CostModel's fields).
STEP_TERM_NAMES = ("seconds_per_iteration", "seconds_per_token", "seconds_per_context_token", "seconds_per_sequence",
                  "seconds_per_attention_pair")


class StepWeight(str, Enum):
    """How much each step counts in a fit, its residual taken relative to its time either way."""

    EQUAL = "equal"  # every step alike (`1/t²` on the absolute residual): a slowed step moves the fit by a bounded share
    TIME = "time"  # each step by its time (`1/t`): the fit prices the run's seconds where they are spent


class CostSource(str, Enum):
    """Where a part of the cost model comes from."""

    PROFILE = "profile"  # a profile passed to the server: never overridden
    CONFIGURED = "configured"  # constants passed to the server (`--seconds-per-*`, `--swap-tokens-per-s`)
    PLACEHOLDER = "placeholder"  # the defaults, not yet (or never) learned
    LEARNED = "learned"  # fitted from this engine's steps or copies


@dataclass(frozen=True, slots=True)
class LearnSettings:
    min_steps: int = 32  # steps before the fit replaces the prior
    prior_steps: float = 2.0  # how many steps the prior weighs (in any direction the steps load)
    memory_steps: float = 4096.0  # steps of memory (forgetting factor 1 - 1/memory_steps)
    refit_every: int = 32  # steps between refits (a refit solves one to 31 systems of 5)
    min_swap_blocks: int = 4  # blocks copied before the measured swap rate replaces the prior

    def __post_init__(self) -> None:
        for name in ("min_steps", "refit_every", "min_swap_blocks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"cost learning: {name} must be a whole number >= 1, got {value!r}")
        if not (math.isfinite(self.prior_steps) and self.prior_steps > 0):
            raise ValueError(f"cost learning: prior_steps must be a finite number > 0, got {self.prior_steps!r}")
        if math.isnan(self.memory_steps) or self.memory_steps < 1:  # inf: forget nothing
            raise ValueError(f"cost learning: memory_steps must be a number >= 1 (or inf), got {self.memory_steps!r}")


@dataclass(frozen=True, slots=True)
class StepShape:
    """What a step computed: the cost model's regressors (`CostModel.iteration_time`'s arguments)."""

    tokens: int
    context_tokens: int
    sequences: int
    attention_pairs: int = 0

    def row(self) -> tuple[float, float, float, float, float]:
        return (1.0, float(self.tokens), float(self.context_tokens), float(self.sequences),
                float(self.attention_pairs))


def terms_of(cost: CostModel) -> tuple[float, float, float, float, float]:
    """A cost model's (c, a, b, d, e)."""
    return (cost.seconds_per_iteration, cost.seconds_per_token, cost.seconds_per_context_token,
            cost.seconds_per_sequence, cost.seconds_per_attention_pair)


def with_terms(cost: CostModel, terms: tuple[float, ...]) -> CostModel:
    """`cost` with its iteration terms replaced by (c, a, b, d, e)."""
    c, a, b, d, e = terms
    return replace(cost, seconds_per_iteration=c, seconds_per_token=a, seconds_per_context_token=b,
                   seconds_per_sequence=d, seconds_per_attention_pair=e)


def nonnegative_quadratic_min(h: np.ndarray, g: np.ndarray) -> np.ndarray:
    """argmin over β >= 0 of `βᵀhβ − 2gᵀβ` (h symmetric positive definite), exactly, by trying every
    subset of free terms: on a subset S the minimum is `β_S = h_SS⁻¹ g_S`, worth `−g_Sᵀβ_S`."""
    n = len(g)
    try:
        whole = np.linalg.solve(h, g)
        if np.all(whole >= 0):  # the usual case: one solve
            return whole
    except np.linalg.LinAlgError:
        pass
    best, best_value = np.zeros(n), 0.0
    for size in range(1, n + 1):
        for subset in itertools.combinations(range(n), size):
            s = list(subset)
            try:
                beta_s = np.linalg.solve(h[np.ix_(s, s)], g[s])
            except np.linalg.LinAlgError:
                continue
            if np.any(beta_s < 0):
                continue
            value = -float(g[s] @ beta_s)
            if value < best_value - 1e-15 * max(abs(best_value), 1.0):
                best, best_value = np.zeros(n), value
                best[s] = beta_s
    return best


class StepTimeFit:
    """The iteration terms (c, a, b, d, e), learned from measured steps (module docstring)."""

    def __init__(self, prior: tuple[float, ...], settings: LearnSettings = LearnSettings(),
                 weight_by: StepWeight = StepWeight.EQUAL) -> None:
        if len(prior) != len(TERMS) or any(not (math.isfinite(v) and v >= 0) for v in prior):
            raise ValueError(f"cost learning: the prior must be {len(TERMS)} finite constants >= 0 {TERMS}, got {prior}")
        self.settings = settings
        self.weight_by = weight_by
        self.prior = tuple(float(v) for v in prior)
        self.steps = 0  # steps observed, all time
        self.weight = 0.0  # steps observed, forgetting included
        self._xtx = np.zeros((len(TERMS), len(TERMS)))
        self._xty = np.zeros(len(TERMS))
        self._pending: list[list[float]] = []  # relative rows of the steps since the last fold
        self._terms = self.prior
        self._fitted_at = 0

    @property
    def learned(self) -> bool:
        return self.steps >= self.settings.min_steps

    @property
    def terms(self) -> tuple[float, ...]:
        """(c, a, b, d, e): the prior until `min_steps` steps, then the latest fit."""
        return self._terms

    def record(self, shape: StepShape, seconds: float) -> None:
        """One step of `shape` took `seconds`: into the statistics, without a refit (`fit` reads them)."""
        if not (math.isfinite(seconds) and seconds > 0):
            raise ValueError(f"cost learning: a step's time must be a finite number > 0 s, got {seconds!r}")
        if min(shape.tokens, shape.context_tokens, shape.sequences, shape.attention_pairs) < 0:
            raise ValueError(f"cost learning: a step's counts must be >= 0, got {shape}")
        # Relative: the row and the time over the time, so the target is 1. Folded in vectorised every
        # `refit_every` steps: a step costs an append, not a 5×5 update in Python.
        self._pending.append([v / seconds for v in shape.row()])
        self.steps += 1
        if len(self._pending) >= self.settings.refit_every:
            self._fold()

    def observe(self, shape: StepShape, seconds: float) -> bool:
        """One step of `shape` took `seconds`. True when the estimate changed (a refit happened)."""
        self.record(shape, seconds)
        if not self.learned:
            return False
        if self._fitted_at and self.steps - self._fitted_at < self.settings.refit_every:
            return False
        self._fitted_at = self.steps
        self._terms = self.fit()
        return True

    def _fold(self) -> None:
        """Add the pending steps to the statistics, each forgotten by its age."""
        if not self._pending:
            return
        x = np.array(self._pending)
        self._pending.clear()
        keep = 1.0 - 1.0 / self.settings.memory_steps
        age = np.arange(len(x) - 1, -1, -1)
        w = keep ** age
        # A relative row's first entry is 1 over the step's time: by time, each row weighs its time.
        weighted = w / x[:, 0] if self.weight_by is StepWeight.TIME else w
        self._xtx = self._xtx * keep ** len(x) + (x * weighted[:, None]).T @ x
        self._xty = self._xty * keep ** len(x) + weighted @ x
        # Steps, not their weights: the prior weighs `prior_steps` average steps either way.
        self.weight = self.weight * keep ** len(x) + float(w.sum())

    def fit(self) -> tuple[float, ...]:
        """The posterior mode under β >= 0 from the data so far (whatever their number)."""
        self._fold()
        diagonal = np.diag(self._xtx)
        seen = diagonal > 0  # a term whose regressor was always 0 (no attention pairs told) keeps its prior
        beta = np.array(self.prior)
        if not np.any(seen) or self.weight <= 0:
            return self.prior
        idx = np.flatnonzero(seen)
        # The prior's precision per term: `prior_steps` average steps' worth of that term's information
        # (moving a term by as much as explains a whole average step costs `prior_steps`).
        precision = self.settings.prior_steps * diagonal[idx] / self.weight
        h = self._xtx[np.ix_(idx, idx)] + np.diag(precision)
        g = self._xty[idx] + precision * beta[idx]
        scale = np.sqrt(np.diag(h))  # solve in unit-diagonal coordinates: terms span 10 orders of magnitude
        solved = nonnegative_quadratic_min(h / np.outer(scale, scale), g / scale) / scale
        beta[idx] = solved
        return tuple(float(v) for v in beta)


class SwapRateFit:
    """Host-link tokens per second: tokens copied over the copies' measured seconds, both ways."""

    def __init__(self, prior_tokens_per_s: float, settings: LearnSettings = LearnSettings()) -> None:
        if not (math.isfinite(prior_tokens_per_s) and prior_tokens_per_s > 0):
            raise ValueError(f"cost learning: the swap-rate prior must be > 0 tokens/s, got {prior_tokens_per_s!r}")
        self.settings = settings
        self.prior = float(prior_tokens_per_s)
        self.blocks = 0
        self.tokens = 0
        self.seconds = 0.0

    @property
    def learned(self) -> bool:
        return self.blocks >= self.settings.min_swap_blocks and self.seconds > 0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.learned else self.prior

    def observe(self, blocks: int, tokens: int, seconds: float) -> None:
        """Copies of `blocks` blocks (`tokens` tokens of KV) landed, taking `seconds` in all."""
        if min(blocks, tokens) < 0 or not (math.isfinite(seconds) and seconds >= 0):
            raise ValueError(f"cost learning: copies of {blocks} blocks, {tokens} tokens in {seconds!r} s")
        self.blocks += blocks
        self.tokens += tokens
        self.seconds += seconds


class LearnedCost:
    """The cost model a server decides with: a profile or given constants as passed, else learned.

    `step_source` and `swap_source` say, per part, where the constants come from: a part that is
    PROFILE or CONFIGURED is never learned; a PLACEHOLDER part becomes LEARNED once its fit has
    enough data.
    """

    def __init__(self, start: CostModel, step_source: CostSource, swap_source: CostSource,
                 settings: LearnSettings = LearnSettings(), learn: bool = True) -> None:
        self.start = start
        self._step_source = step_source
        self._swap_source = swap_source
        learn_step = learn and step_source is CostSource.PLACEHOLDER
        learn_swap = learn and swap_source is CostSource.PLACEHOLDER
        self.step = StepTimeFit(terms_of(start), settings) if learn_step else None
        # The whole run's fit, for the record only, each step weighed by its time (module docstring).
        self.run = (StepTimeFit(terms_of(start), replace(settings, memory_steps=math.inf), StepWeight.TIME)
                    if learn_step else None)
        self.swap = SwapRateFit(start.swap_tokens_per_s, settings) if learn_swap else None
        self.cost = start

    @property
    def learning(self) -> bool:
        return self.step is not None or self.swap is not None

    @property
    def step_source(self) -> CostSource:
        return CostSource.LEARNED if self.step is not None and self.step.learned else self._step_source

    @property
    def swap_source(self) -> CostSource:
        return CostSource.LEARNED if self.swap is not None and self.swap.learned else self._swap_source

    def observe_step(self, shape: StepShape, seconds: float) -> bool:
        """A measured step; True when the cost model changed."""
        if self.step is None:
            return False
        assert self.run is not None
        self.run.record(shape, seconds)
        if not self.step.observe(shape, seconds):
            return False
        self.cost = with_terms(self.cost, self.step.terms)
        return True

    def observe_copies(self, blocks: int, tokens: int, seconds: float) -> bool:
        """Measured copies; True when the cost model changed."""
        if self.swap is None or blocks <= 0:
            return False
        self.swap.observe(blocks, tokens, seconds)
        if not self.swap.learned:
            return False
        self.cost = replace(self.cost, swap_tokens_per_s=self.swap.tokens_per_s)
        return True

    def snapshot(self) -> dict[str, object]:
        """What `/marsched/state` shows: the terms in use and where they come from."""
        c, a, b, d, e = terms_of(self.cost)
        return {
            "step_source": self.step_source.value,
            "swap_source": self.swap_source.value,
            "seconds_per_iteration": c, "seconds_per_token": a, "seconds_per_context_token": b,
            "seconds_per_sequence": d, "seconds_per_attention_pair": e,
            "swap_tokens_per_s": self.cost.swap_tokens_per_s,
            "token_budget": self.cost.token_budget,
            "steps": self.step.steps if self.step is not None else 0,
            "min_steps": self.step.settings.min_steps if self.step is not None else None,
            "swap_blocks": self.swap.blocks if self.swap is not None else 0,
            "swap_seconds": self.swap.seconds if self.swap is not None else 0.0,
            "run": self.run_terms(),
        }

    def run_terms(self) -> dict[str, float] | None:
        """The whole run's step terms (`run`, never decided with), fitted now; None until it has
        `min_steps` steps or where the step terms are not learned."""
        if self.run is None or not self.run.learned:
            return None
        return dict(zip(STEP_TERM_NAMES, self.run.fit())) | {"steps": self.run.steps}

"""Least-squares fits of measured engine costs: iteration time and swap time.

Pure functions over plain numbers (numpy only), so that they are tested on synthetic data.

Iteration time is modelled as `t = c + a·new_tokens + b·context_tokens + d·sequences + e·attention_pairs`:

- `new_tokens`: tokens the step computes (prefill chunks plus one per decoding sequence);
- `context_tokens`: KV tokens attention reads, summed over the scheduled sequences (each
  sequence's context after the step, this step's tokens included: `bench.steps`' `ctx`);
- `sequences`: sequences scheduled (per-sequence work: sampling, metadata, output handling);
- `attention_pairs`: (new token, context token) pairs causal attention computes
  (`policy.cost_model.attention_pairs`; `bench.steps`' `pairs`).

`e` is fitted only when the samples support it: when the pairs vary independently of the other
four columns (prefill of two or more sizes, beside decode steps, makes them grow as N(N+1)/2 against N). Otherwise
the fit is the four-term one with `e = 0`, and `IterationFit.attention` says why.

Every constant is a cost, so the fit is non-negative least squares. With five unknowns the
exact solution is found by trying every subset of terms (31 ordinary least-squares solves)
and keeping the best one whose coefficients are all >= 0: no solver dependency, no iteration.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

TERMS = ("c", "a", "b", "d")  # fixed, per new token, per context token, per sequence
ATTENTION_TERM = "e"  # per attention pair, fitted where the samples separate it


@dataclass(frozen=True, slots=True)
class StepSample:
    """One measured configuration: the step's shape and its (median) time in seconds."""

    new_tokens: int
    context_tokens: int
    sequences: int
    seconds: float
    repeats: int = 1  # steps the median was taken over
    attention_pairs: int = 0  # 0 everywhere: not measured, so `e` is not fitted


@dataclass(frozen=True, slots=True)
class FitQuality:
    r2: float  # 1 - SS_res / SS_tot (nan when the times do not vary)
    relative_rms: float  # RMS of residual / measured time (what the relative fit minimises)
    max_relative_error: float  # largest |residual| / time
    samples: int


@dataclass(frozen=True, slots=True)
class IterationFit:
    """Seconds: `c` per step, `a` per new token, `b` per context token, `d` per sequence, `e` per
    attention pair; `attention` says whether `e` was fitted and, if not, why."""

    c: float
    a: float
    b: float
    d: float
    quality: FitQuality
    e: float = 0.0
    attention: str = ""

    def predict(self, new_tokens: float, context_tokens: float, sequences: float, attention_pairs: float = 0) -> float:
        return (self.c + self.a * new_tokens + self.b * context_tokens + self.d * sequences
                + self.e * attention_pairs)


@dataclass(frozen=True, slots=True)
class LineFit:
    """`y = intercept + slope·x` (both >= 0)."""

    intercept: float
    slope: float
    quality: FitQuality


def fit_quality(observed: np.ndarray, predicted: np.ndarray) -> FitQuality:
    residual = observed - predicted
    spread = float(np.sum((observed - observed.mean()) ** 2))
    r2 = 1 - float(np.sum(residual ** 2)) / spread if spread > 0 else math.nan
    if not np.all(observed > 0):
        return FitQuality(r2, math.nan, math.nan, int(observed.size))
    relative = residual / observed
    return FitQuality(r2, float(np.sqrt(np.mean(relative ** 2))), float(np.max(np.abs(relative))), int(observed.size))


def nonnegative_least_squares(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """argmin ||x·β - y|| over β >= 0, exactly, by trying every subset of columns (few columns only)."""
    columns = x.shape[1]
    if columns > 8:
        raise ValueError(f"exhaustive NNLS is for a few terms, got {columns}")
    best, best_cost = np.zeros(columns), float(np.sum(y ** 2))
    for size in range(1, columns + 1):
        for subset in itertools.combinations(range(columns), size):
            beta_sub, *_ = np.linalg.lstsq(x[:, subset], y, rcond=None)
            if np.any(beta_sub < 0):
                continue
            cost = float(np.sum((x[:, subset] @ beta_sub - y) ** 2))
            if cost < best_cost - 1e-18:
                best = np.zeros(columns)
                best[list(subset)] = beta_sub
                best_cost = cost
    return best


def _check_samples(samples: list[StepSample]) -> None:
    for index, s in enumerate(samples):
        if not (math.isfinite(s.seconds) and s.seconds > 0):
            raise ValueError(f"sample {index}: time must be a finite number > 0 s, got {s.seconds!r}")
        if min(s.new_tokens, s.context_tokens, s.sequences, s.attention_pairs) < 0:
            raise ValueError(f"sample {index}: counts must be >= 0, got {s}")


def attention_support(samples: list[StepSample]) -> str | None:
    """None when the samples determine `e` beside the four other terms; else why they do not."""
    if not any(s.attention_pairs for s in samples):
        return "not fitted: the samples carry no attention pairs"
    if len(samples) < len(TERMS) + 3:
        return f"not fitted: {len(samples)} samples, and five constants need {len(TERMS) + 3}"
    x = np.array([[1.0, s.new_tokens, s.context_tokens, s.sequences, s.attention_pairs] for s in samples])
    if np.linalg.matrix_rank(x) < x.shape[1]:
        return ("not fitted: the attention pairs do not vary apart from the other terms "
                "(prefill of two or more sizes separates them)")
    return None


def fit_iteration_time(samples: list[StepSample], relative: bool = True) -> IterationFit:
    """Fit `c + a·new + b·context + d·sequences (+ e·attention_pairs)` (all >= 0) to the samples.

    `relative`: weight each sample by 1/time, i.e. minimise relative errors, so that a 3 ms
    decode step counts as much as a 300 ms prefill (otherwise the long steps decide alone).
    `e` joins the fit where `attention_support` finds the samples determine it.
    Raises ValueError when the samples cannot determine the four constants: fewer than 6, or
    no two different values of a term (new tokens equal to sequences everywhere, for example,
    cannot separate `a` from `d`: measure prefill steps too).
    """
    _check_samples(samples)
    unsupported = attention_support(samples)
    if unsupported is None:
        return _fit_with_attention(samples, relative)
    if len(samples) < len(TERMS) + 2:
        raise ValueError(f"{len(samples)} samples cannot fit {len(TERMS)} constants with an error estimate; "
                         f"give at least {len(TERMS) + 2} (prefill sizes and decode batch × context points)")
    x = np.array([[1.0, s.new_tokens, s.context_tokens, s.sequences] for s in samples])
    y = np.array([s.seconds for s in samples])
    if np.linalg.matrix_rank(x) < x.shape[1]:
        raise ValueError("the samples do not separate the terms (new tokens, context tokens, sequences must each "
                         "vary independently of the others: measure prefill of several sizes and decode over "
                         "several batch sizes and contexts)")
    weights = 1.0 / y if relative else np.ones_like(y)
    beta = nonnegative_least_squares(x * weights[:, None], y * weights)
    c, a, b, d = (float(v) for v in beta)
    return IterationFit(c, a, b, d, fit_quality(y, x @ beta), attention=unsupported)


def _fit_with_attention(samples: list[StepSample], relative: bool) -> IterationFit:
    x = np.array([[1.0, s.new_tokens, s.context_tokens, s.sequences, s.attention_pairs] for s in samples])
    y = np.array([s.seconds for s in samples])
    weights = 1.0 / y if relative else np.ones_like(y)
    beta = nonnegative_least_squares(x * weights[:, None], y * weights)
    c, a, b, d, e = (float(v) for v in beta)
    return IterationFit(c, a, b, d, fit_quality(y, x @ beta), e=e, attention="fitted")


def fit_line(xs: list[float], ys: list[float], through_origin: bool = False) -> LineFit:
    """`y = intercept + slope·x`, both >= 0 (e.g. swap seconds over blocks copied).

    `through_origin`: no intercept (`y = slope·x`, as the cost model's swap time); the slope is
    then > 0 whenever some y is, even when noise makes the times fall with x."""
    if len(xs) != len(ys):
        raise ValueError(f"{len(xs)} x values for {len(ys)} y values")
    if len(set(xs)) < 2 or len(xs) < 3:
        raise ValueError(f"a line needs at least 3 points at 2 or more x values, got {len(xs)} at {len(set(xs))}")
    x = np.array([[v] if through_origin else [1.0, v] for v in xs], dtype=float)
    y = np.array(ys, dtype=float)
    beta = nonnegative_least_squares(x, y)
    intercept, slope = (0.0, float(beta[0])) if through_origin else (float(beta[0]), float(beta[1]))
    return LineFit(intercept, slope, fit_quality(y, x @ beta))

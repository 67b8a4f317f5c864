"""The Gittins rank of a program whose number of turns left is uncertain.

A program's size is unknown to a server: it sees the turns so far, and the programs that ended
tell how many turns programs that got this far still had (`ProgramLengths.turns_left_counts`).
For unknown sizes the order that minimises the mean is the Gittins index over attained service
(Gittins; for M/G/1, Scully & Harchol-Balter's SOAP framework): a job's rank is the least, over
horizons Δ, of the expected work it takes to reach Δ divided by the chance it finishes by then.
With known sizes that is the remaining size (shortest remaining first); where programs that ran
long tend to run longer still, it favours the young ones (least attained service).

Here the work is the key's memory × time: the current turn's (`current_s`, at the engine's τ
now) and, for the turns to the horizon, `rest_area_per_iteration`, which is linear in E[min(N,Δ)]
and E[min(N,Δ)²]. The horizons tried are the turn counts seen (at most `MAX_HORIZONS` of
them, evenly by weight, when more are seen).
"""

from __future__ import annotations

from marsched.policy.program import ProgramOutlook, rest_area_per_iteration

MAX_HORIZONS = 48  # horizons tried per rank: the distinct turn counts, thinned by weight past this


def horizons(counts: list[tuple[int, float]]) -> list[int]:
    """Indices into `counts` to try as horizons: all of them, or `MAX_HORIZONS` spread by weight
    (the last always, so that the whole program is a candidate)."""
    if len(counts) <= MAX_HORIZONS:
        return list(range(len(counts)))
    total = sum(w for _, w in counts)
    chosen, cumulative, next_mark = [], 0.0, total / MAX_HORIZONS
    for index, (_, weight) in enumerate(counts):
        cumulative += weight
        if cumulative >= next_mark:
            chosen.append(index)
            next_mark = cumulative + total / MAX_HORIZONS
    if chosen[-1] != len(counts) - 1:
        chosen.append(len(counts) - 1)
    return chosen


def gittins_outlook(counts: list[tuple[int, float]], current_s: float, context_tokens: int,
                    output_tokens: float, growth_tokens: float, iteration_s: float) -> ProgramOutlook:
    """The outlook to the horizon of least rank: (current_s + τ·rest to Δ) / P(N ≤ Δ).

    `counts`: (turns left, weight) sorted by turns; `current_s`: the current turn's key at τ
    (token·s); the rest is priced from `context_tokens` with turns of `output_tokens` replies
    that grow the context by `growth_tokens`."""
    total = sum(w for _, w in counts)
    if total <= 0:
        raise ValueError("a Gittins rank needs at least one program's turns")
    candidates = set(horizons(counts))
    best: ProgramOutlook | None = None
    best_rank = 0.0
    below_w = below_n = below_sq = 0.0  # weight, Σ w·n and Σ w·n² of the programs ending by Δ
    for index, (turns, weight) in enumerate(counts):
        below_w += weight
        below_n += weight * turns
        below_sq += weight * turns * turns
        if index not in candidates:
            continue
        beyond = total - below_w  # still running at the horizon: they count Δ turns
        outlook = ProgramOutlook((below_n + beyond * turns) / total, output_tokens, growth_tokens,
                                 (below_sq + beyond * turns * turns) / total, min(below_w / total, 1.0))
        rank = (current_s + iteration_s * rest_area_per_iteration(outlook, context_tokens)) / outlook.completion
        if best is None or rank < best_rank:
            best, best_rank = outlook, rank
    return best

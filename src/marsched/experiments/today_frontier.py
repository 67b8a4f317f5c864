"""MARS's mean/p99 trade-off against today's baselines: its starvation and order variants on every set of
results/today/commands.sh, each load against the best other policy at that load.

    python -m marsched.experiments.today_frontier run [SET|VARIANT...]
                                                          the variants' runs (on every set, or the
                                                          sets named; every variant, or those of the
                                                          file keys named): results/today/frontier/*.json
    python -m marsched.experiments.today_frontier         the table (docs/results.md) and frontier.png

Each variant is scored as the goals read: its worst mean ratio over the loads (against the best
other policy by mean at each load), its mean ratio at the most loaded point, and its worst p99
ratio over the loads (against the best other by p99), and its worst p99 slowdown ratio the same
way. The default's runs are the MARS records of results/today/<set>.json; the other policies'
records come from there too (`vllm-v0` is there for reference only, as in docs/results.md). The
bound's row reads results/today/bound/ (MARS told the future): a bound, not a setting anyone can run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3] / "results" / "today"
MEAN_GOAL_TOP = 0.6  # mean at the most loaded point over the best other's
TIE = 1.01  # mean and p99 at every load over the best other's
REFERENCE_ONLY = "vllm-v0"  # the paper's engine, run for reference: not one of the "other" policies


@dataclass(frozen=True)
class TodaySet:
    name: str  # results/today/<name>.json
    trace: str
    profile: str
    loads: tuple[float, ...]
    token_scale: float = 1.0

    def compare(self, loads: tuple[float, ...], flags: tuple[str, ...], out: Path) -> None:
        """`marsched compare` on this set at `loads` with `flags`, as results/today/commands.sh runs
        it (600 s, seed 0), its records to `out`."""
        subprocess.run([sys.executable, "-m", "marsched.cli", "compare", "--trace", self.trace, "--profile", self.profile,
                        "--token-scale", f"{self.token_scale:g}", *flags, "--qps", ",".join(f"{q:g}" for q in loads),
                        "--duration", "600", "--seed", "0", "--json", str(out)], check=True, stdout=subprocess.DEVNULL)


SETS = (
    TodaySet("claude-code-llama3-8b-h100", "claude-code", "llama3-8b-h100", (0.25, 0.5, 1, 2, 4), 0.14),
    TodaySet("claude-code-llama3-70b-4xh100", "claude-code", "llama3-70b-4xh100", (0.125, 0.25, 0.5, 1, 2), 0.14),
    TodaySet("multi-gptj-6b-a100", "multi", "gptj-6b-a100", (3, 4, 5, 6)),
    TodaySet("multi-llama3-8b-h100", "multi", "llama3-8b-h100", (8, 16, 32, 48)),
    TodaySet("multi-llama3-70b-4xh100", "multi", "llama3-70b-4xh100", (4, 8, 16, 24)),
    TodaySet("single-gptj-6b-a100", "single", "gptj-6b-a100", (3, 4, 5, 6)),
    TodaySet("single-llama3-8b-h100", "single", "llama3-8b-h100", (16, 32, 48, 64)),
    TodaySet("single-llama3-70b-4xh100", "single", "llama3-70b-4xh100", (8, 16, 24, 32)),
    TodaySet("agent-gptj-6b-a100", "agent", "gptj-6b-a100", (0.1, 0.2, 0.4)),
    TodaySet("agent-llama3-8b-h100", "agent", "llama3-8b-h100", (0.4, 1.6, 3.2, 6.4)),
    TodaySet("agent-llama3-70b-4xh100", "agent", "llama3-70b-4xh100", (0.2, 0.8, 1.6, 2.4)),
)


def sets_named(names: list[str]) -> tuple[TodaySet, ...]:
    """The sets of these names, in the order given; ValueError naming the unknown ones and the sets."""
    by_name = {s.name: s for s in SETS}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise ValueError(f"no set {', '.join(unknown)}; the sets: {', '.join(by_name)}")
    return tuple(by_name[n] for n in names)


@dataclass(frozen=True)
class Compare:
    label: str  # for progress lines
    set: TodaySet
    loads: tuple[float, ...]
    flags: tuple[str, ...]
    out: Path


def run_compares(todo: list[Compare], workers: int | None = None) -> None:
    """Run the compares, one process each, as many at a time as there are cores; a line on
    stderr as each ends. A failed one stops the rest (its error is raised)."""
    from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

    workers = workers or os.cpu_count() or 1
    with ThreadPoolExecutor(workers) as pool:
        pending = {pool.submit(c.set.compare, c.loads, c.flags, c.out): c for c in todo}
        done = 0
        while pending:
            finished, _ = wait(pending, return_when=FIRST_COMPLETED)
            for future in finished:
                c = pending.pop(future)
                if future.exception() is not None:
                    for other in pending:
                        other.cancel()
                    raise future.exception()
                done += 1
                print(f"[{done}/{len(todo)}] {c.label}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Variant:
    label: str
    args: tuple[str, ...]  # marsched compare's policy and order flags
    file: str  # results/today/<folder>/<set>-<file>.json; "" for the default (the set's own runs)
    policy: str = "mars"  # the records' policy name
    folder: str = "frontier"  # "bound": results/today/bound/<set>.json, run by commands.sh, not here

    def path(self, today: Path, set_name: str) -> Path:
        if not self.file:
            return today / f"{set_name}.json"
        if self.folder == "bound":
            return today / "bound" / f"{set_name}.json"
        return today / self.folder / f"{set_name}-{self.file}.json"

    @property
    def runs_here(self) -> bool:
        return bool(self.file) and self.folder == "frontier"


BOOST_GAMMAS = (0.003, 0.01, 0.03)  # per device second: the sweep of docs/results.md, "Bounded overtaking"
NUDGE_MS = (1, 3)  # Nudge-M's window: 1 is the original Nudge, 3 mars-nudge's default


def variants() -> list[Variant]:
    """The `fcfs-wait` multiples (2 is the default), `age` thresholds, no prevention at all, the
    bounded-overtaking orders, and MARS told the future (a bound, not a setting)."""
    from marsched.policy.boost import DEFAULT_BOOST_GAMMA
    from marsched.policy.nudge import DEFAULT_NUDGE_M
    from marsched.policy.registry import DEFAULT_STARVATION, STARVATION_VARIANTS

    default = STARVATION_VARIANTS[DEFAULT_STARVATION]
    out = []
    for multiple in (0.8, 1, 1.5, 2, 4):
        if DEFAULT_STARVATION == "fcfs-wait" and multiple == default.fcfs_multiple:
            out.append(Variant(f"fcfs-wait:{multiple:g} (default)", (), ""))
        else:
            out.append(Variant(f"fcfs-wait:{multiple:g}", ("--policies", "mars", "--starvation", f"fcfs-wait:{multiple:g}"),
                               f"fcfs{multiple:g}"))
    for threshold in (15, 60):
        out.append(Variant(f"age {threshold} s", ("--policies", "mars", "--starvation", "age",
                                                  "--starvation-threshold", str(threshold)), f"age{threshold}"))
    out.append(Variant("off", ("--policies", "mars", "--starvation", "off"), "off"))
    for gamma in BOOST_GAMMAS:
        default_mark = " (its default)" if gamma == DEFAULT_BOOST_GAMMA else ""
        out.append(Variant(f"mars-boost γ {gamma:g}{default_mark}", ("--policies", "mars-boost", "--boost-gamma", f"{gamma:g}"),
                           f"boost{gamma:g}", policy="mars-boost"))
    out.append(Variant(f"mars-boost-label γ {DEFAULT_BOOST_GAMMA:g}", ("--policies", "mars-boost-label"),
                       "boost-label", policy="mars-boost-label"))
    for window in NUDGE_MS:
        default_mark = " (its default)" if window == DEFAULT_NUDGE_M else ""
        out.append(Variant(f"mars-nudge M {window}{default_mark}", ("--policies", "mars-nudge", "--nudge-m", str(window)),
                           f"nudge{window}", policy="mars-nudge"))
    return out + [Variant("bound: told the future (default starvation)", (), "bound", folder="bound")]


def run(names: tuple[str, ...] = ()) -> None:
    """The variants run here on the sets, all loads in one compare each. `names`: set names and
    variant file keys; with none of either kind, every one of that kind."""
    here = [v for v in variants() if v.runs_here]
    set_names = {s.name for s in SETS}
    unknown = sorted(set(names) - set_names - {v.file for v in here})
    if unknown:
        raise ValueError(f"no set or variant {', '.join(unknown)}; the sets: {', '.join(s.name for s in SETS)}; "
                         f"the variants: {', '.join(v.file for v in here)}")
    sets = [s for s in SETS if s.name in names] or list(SETS)
    chosen = [v for v in here if v.file in names] or here
    folder = ROOT / "frontier"
    folder.mkdir(parents=True, exist_ok=True)
    run_compares([Compare(f"{s.name} {v.label}", s, s.loads, v.args, v.path(ROOT, s.name)) for s in sets for v in chosen])


@dataclass(frozen=True)
class Score:
    worst_mean: float  # max over loads of MARS's mean / the best other's
    top_mean: float  # at the most loaded point
    worst_p99: float  # max over loads of MARS's p99 / the best other's (by p99)
    worst_slowdown_p99: float | None = None  # max over loads of its p99 slowdown / the best other's; None
    # where a load's records have no slowdown


def best_other(others: list[dict], qps: float, metric: str) -> dict:
    """The other policies' record with the least `metric` at `qps`."""
    return min((r for r in others if r["qps"] == qps), key=lambda r: r[metric])


def worst_ratio(mars: dict[float, dict], others: list[dict], loads: tuple[float, ...], metric: str) -> float | None:
    """Max over `loads` of MARS's `metric` over the best other's; None if any record lacks it."""
    if any(mars[q].get(metric) is None or any(r.get(metric) is None for r in others if r["qps"] == q) for q in loads):
        return None
    return max(mars[q][metric] / best_other(others, q, metric)[metric] for q in loads)


def score(mars: dict[float, dict], others: list[dict], loads: tuple[float, ...]) -> Score:
    """`mars`: MARS's record per load; `others`: every other policy's records of the set."""
    mean_ratios = [mars[q]["e2e_mean_s"] / best_other(others, q, "e2e_mean_s")["e2e_mean_s"] for q in loads]
    return Score(max(mean_ratios), mean_ratios[-1], worst_ratio(mars, others, loads, "e2e_p99_s"),
                 worst_ratio(mars, others, loads, "slowdown_p99"))


def others_of(records: list[dict]) -> list[dict]:
    """The records of the policies MARS is measured against (not MARS, not the reference engine)."""
    return [r for r in records if r["policy"] not in ("mars", REFERENCE_ONLY)]


def scores(today: Path = ROOT) -> dict[str, dict[str, Score]]:
    """Set name -> variant label -> its score, for the variants whose runs are there."""
    out: dict[str, dict[str, Score]] = {}
    for s in SETS:
        if not (today / f"{s.name}.json").exists():
            continue
        records = json.loads((today / f"{s.name}.json").read_text())
        others = others_of(records)
        for v in variants():
            path = v.path(today, s.name)
            if not path.exists():
                continue
            mars = {r["qps"]: r for r in json.loads(path.read_text()) if r["policy"] == v.policy}
            if all(q in mars for q in s.loads):
                out.setdefault(s.name, {})[v.label] = score(mars, others, s.loads)
    return out


def cell(c: Score) -> str:
    slowdown = "–" if c.worst_slowdown_p99 is None else f"{c.worst_slowdown_p99:.2f}"
    return f"{c.worst_mean:.2f} / {c.top_mean:.2f} / {c.worst_p99:.2f} / {slowdown}"


def table(by_set: dict[str, dict[str, Score]]) -> str:
    """One row per variant, one column per set; each cell: worst mean / mean at the most loaded
    point / worst p99 / worst p99 slowdown, over the best other policy's."""
    names = list(by_set)
    lines = ["| variant | " + " | ".join(names) + " |", "| --- |" + " --- |" * len(names)]
    for v in variants():
        cells = [cell(c) if (c := by_set[n].get(v.label)) else "" for n in names]
        lines.append(f"| {v.label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


COLORS = (("fcfs-wait", "tab:blue"), ("age", "tab:orange"), ("mars-boost-label", "tab:olive"),
          ("mars-boost", "tab:green"), ("mars-nudge", "tab:purple"), ("bound", "black"))


def plot(by_set: dict[str, dict[str, Score]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = min(4, len(by_set))
    rows = -(-len(by_set) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4.6 * columns, 4.4 * rows), squeeze=False)
    for ax in axes.flat[len(by_set):]:
        ax.set_visible(False)
    for ax, (name, by_variant) in zip(axes.flat, by_set.items()):
        fcfs = [(c.worst_p99, c.top_mean) for label, c in by_variant.items() if label.startswith("fcfs-wait")]
        ax.plot([p for p, _ in fcfs], [m for _, m in fcfs], "-", color="tab:blue", alpha=0.5, zorder=1)
        for label, c in by_variant.items():
            color = next((c for prefix, c in COLORS if label.startswith(prefix)), "tab:gray")
            star = "default" in label
            ax.scatter([c.worst_p99], [c.top_mean], color=color, marker="*" if star else "o", s=160 if star else 40,
                       zorder=2)
            ax.annotate(label.replace(" (default)", "*"), (c.worst_p99, c.top_mean), fontsize=7, xytext=(4, 3),
                        textcoords="offset points")
        ax.axvline(TIE, color="black", lw=0.8)
        ax.axhline(MEAN_GOAL_TOP, color="black", lw=0.8, ls="--")
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("worst p99 over the loads / best other's")
        ax.set_ylabel("mean at the most loaded point / best other's")
    fig.suptitle("MARS's starvation and order variants against today's baselines: lower left is better")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str]) -> int:
    if argv[:1] == ["run"]:
        try:
            run(tuple(argv[1:]))
        except ValueError as e:
            print(f"today_frontier: {e}", file=sys.stderr)
            return 2
        return 0
    if argv:
        print("usage: python -m marsched.experiments.today_frontier [run [SET|VARIANT...]]", file=sys.stderr)
        return 2
    by_set = scores(ROOT)
    if not by_set:
        print(f"today_frontier: no results in {ROOT}: run results/today/commands.sh first", file=sys.stderr)
        return 1
    print(table(by_set))
    plot(by_set, ROOT / "frontier" / "frontier.png")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

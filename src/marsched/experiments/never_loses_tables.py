"""The README's tables from the results of scripts/never_loses.sh (one run set's folder), and the
mean/p99 trade-off at each trace's most loaded point (`frontier.png` in that folder).
`scripts/never_loses_tables.py [SET] [TRACE ...]` prints them (`print_tables`)."""

from __future__ import annotations

import json
import statistics
import warnings
from dataclasses import dataclass
from pathlib import Path

from marsched.experiments.never_loses_sets import FRONTIER_AGES_S, FRONTIER_MULTIPLES, RUN_SETS, SEEDS


@dataclass(frozen=True)
class SetResults:
    """Where one run set's results are, and what the tables need to know of the set."""

    folder: Path  # the run set's folder (results/never-loses, ...)
    label: str  # the profile's name in tables and plots
    top: dict[str, float]  # the most loaded point of each trace
    seeds: tuple[int, ...] = SEEDS  # of the seed sweep

    def load(self, name: str) -> list[dict]:
        path = self.folder / f"{name}.json"
        return json.loads(path.read_text()) if path.exists() else []


def set_results(run_set: str, results: Path) -> SetResults:
    """The run set's results under `results` (the repository's results/ folder)."""
    chosen = RUN_SETS[run_set]
    return SetResults(results / chosen.folder, chosen.label, chosen.top)


def _by(records: list[dict], policy: str) -> dict[float, dict]:
    return {r["qps"]: r for r in records if r["policy"] == policy}


def main_table(results: SetResults, trace: str) -> None:
    main = results.load(f"{trace}-main")
    if not main:
        return
    vllm, infercept, mars = _by(main, "vllm"), _by(main, "infercept"), _by(main, "mars")
    noisy = {s: _by(results.load(f"{trace}-noisy{s}"), "mars") for s in ("0.3", "0.6")}
    bound = _by(results.load(f"{trace}-bound"), "mars")
    print(f"\n**{trace}** (mean / p99 end-to-end s; ratios are MARS over INFERCEPT)\n")
    print("| qps | vllm | infercept | mars | mean ratio | p99 ratio | mars max wait s | noisy:0.3 mean ratio "
          "| noisy:0.6 mean ratio | bound (foreknowledge): mean / p99 ratio |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for qps in sorted(infercept):
        i, m, v = infercept[qps], mars.get(qps), vllm.get(qps)
        if m is None:
            continue
        cells = [f"{qps:g}", f"{v['e2e_mean_s']:.1f} / {v['e2e_p99_s']:.0f}" if v else "",
                 f"{i['e2e_mean_s']:.1f} / {i['e2e_p99_s']:.0f}", f"{m['e2e_mean_s']:.1f} / {m['e2e_p99_s']:.0f}",
                 f"{m['e2e_mean_s'] / i['e2e_mean_s']:.2f}", f"{m['e2e_p99_s'] / i['e2e_p99_s']:.2f}",
                 f"{m['max_queue_wait_s']:.1f}"]
        for sigma in ("0.3", "0.6"):
            n = noisy[sigma].get(qps)
            cells.append(f"{n['e2e_mean_s'] / i['e2e_mean_s']:.2f}" if n else "")
        b = bound.get(qps)
        cells.append(f"{b['e2e_mean_s'] / i['e2e_mean_s']:.2f} / {b['e2e_p99_s'] / i['e2e_p99_s']:.2f}" if b else "")
        print("| " + " | ".join(cells) + " |")


def code_table(results: SetResults, traces: list[str]) -> None:
    """MARS and the paper-rule `infercept` against INFERCEPT's code (`infercept-code`), per trace and qps."""
    rows = []
    for trace in traces:
        main, code = results.load(f"{trace}-main"), _by(results.load(f"{trace}-infercept-code"), "infercept-code")
        infercept, mars = _by(main, "infercept"), _by(main, "mars")
        for qps in sorted(code):
            c, i, m = code[qps], infercept.get(qps), mars.get(qps)
            if i is None or m is None:
                continue
            rows.append(f"| {trace} | {qps:g} | {c['e2e_mean_s']:.1f} / {c['e2e_p99_s']:.0f} | "
                        f"{i['e2e_mean_s'] / c['e2e_mean_s']:.2f}, {i['e2e_p99_s'] / c['e2e_p99_s']:.2f} | "
                        f"{m['e2e_mean_s'] / c['e2e_mean_s']:.2f}, {m['e2e_p99_s'] / c['e2e_p99_s']:.2f} |")
    if rows:
        print("\n| trace | qps | infercept-code mean / p99 s | infercept / code: mean, p99 | mars / code: mean, p99 |")
        print("| --- | --- | --- | --- | --- |")
        print("\n".join(rows))


def ablation_table(results: SetResults, trace: str) -> None:
    infercept = _by(results.load(f"{trace}-main"), "infercept")
    variants = [("fcfs-wait + predicted-peak (default)", f"{trace}-main"), ("age + predicted-peak", f"{trace}-age"),
                ("published + predicted-peak", f"{trace}-published"),
                ("iterations + predicted-peak", f"{trace}-iterations"), ("off + predicted-peak", f"{trace}-off"),
                ("fcfs-wait + greedy", f"{trace}-fcfs-wait-greedy"), ("age + greedy", f"{trace}-age-greedy"),
                ("published + greedy", f"{trace}-published-greedy"),
                ("iterations + greedy (0.1 default)", f"{trace}-iterations-greedy"), ("off + greedy", f"{trace}-off-greedy")]
    rows = [(label, _by(results.load(name), "mars")) for label, name in variants]
    rows = [(label, r) for label, r in rows if r]
    if not rows or not infercept:
        return
    loads = sorted(infercept)
    print(f"\n**{trace}**: mean / p99 over INFERCEPT's, and max queue wait (s), per qps\n")
    print("| variant | " + " | ".join(f"{q:g}" for q in loads) + " |")
    print("| --- | " + " | ".join("---" for _ in loads) + " |")
    for label, by_qps in rows:
        cells = []
        for q in loads:
            r, i = by_qps.get(q), infercept[q]
            cells.append(f"{r['e2e_mean_s'] / i['e2e_mean_s']:.2f} / {r['e2e_p99_s'] / i['e2e_p99_s']:.2f} / "
                         f"{r['max_queue_wait_s']:.0f}" if r else "")
        print(f"| {label} | " + " | ".join(cells) + " |")


def frontier_variants() -> list[tuple[str, str]]:
    """(label, results file suffix) of every variant on the frontier, in the tables' order: the
    `fcfs-wait` multiples and `age` thresholds never_loses.sh runs there, with each variant's own
    (the default's runs are `main`, age's own are `age`), then the other variants."""
    from marsched.policy.registry import DEFAULT_STARVATION, STARVATION_VARIANTS

    own_multiple = STARVATION_VARIANTS["fcfs-wait"].fcfs_multiple
    own_age = STARVATION_VARIANTS["age"].threshold
    default = " (default)" if DEFAULT_STARVATION == "fcfs-wait" else ""
    variants = [(f"fcfs-wait:{m:g}{default}", "main") if m == own_multiple else (f"fcfs-wait:{m:g}", f"fcfs{m:g}")
                for m in sorted({*FRONTIER_MULTIPLES, own_multiple})]
    variants += [(f"age {t:g} s", "age") if t == own_age else (f"age {t:g} s", f"age{t:g}")
                 for t in sorted({*FRONTIER_AGES_S, own_age})]
    return variants + [("published", "published"), ("iterations", "iterations"), ("off", "off")]


def frontier_points(results: SetResults, trace: str) -> list[tuple[str, float, float]]:
    """(variant, mean ratio, p99 ratio) at the trace's most loaded point, over INFERCEPT's."""
    infercept = _by(results.load(f"{trace}-main"), "infercept").get(results.top[trace])
    if infercept is None:
        return []
    points = []
    for label, name in frontier_variants():
        r = _by(results.load(f"{trace}-{name}"), "mars").get(results.top[trace])
        if r is not None:
            points.append((label, r["e2e_mean_s"] / infercept["e2e_mean_s"], r["e2e_p99_s"] / infercept["e2e_p99_s"]))
    return points


def frontier_table(results: SetResults, traces: list[str]) -> None:
    columns = [label for label, _, _ in frontier_points(results, traces[0])] if traces else []
    rows = []
    for trace in traces:
        points = {label: (mean, p99) for label, mean, p99 in frontier_points(results, trace)}
        if points:
            rows.append(f"| {trace} {results.top[trace]:g} qps | " + " | ".join(
                f"{points[c][0]:.2f} / {points[c][1]:.2f}" if c in points else "" for c in columns) + " |")
    if rows:
        print("\n| mean / p99 over INFERCEPT's | " + " | ".join(columns) + " |")
        print("| --- | " + " | ".join("---" for _ in columns) + " |")
        print("\n".join(rows))


def frontier_plot(results: SetResults, traces: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traces = [t for t in traces if frontier_points(results, t)]
    if not traces:
        return
    fig, axes = plt.subplots(1, len(traces), figsize=(5.2 * len(traces), 4.6), squeeze=False)
    for ax, trace in zip(axes[0], traces):
        points = frontier_points(results, trace)
        fcfs = [(m, p) for label, m, p in points if label.startswith("fcfs-wait")]
        ax.plot([p for _, p in fcfs], [m for m, _ in fcfs], "-", color="tab:blue", alpha=0.5, zorder=1)
        for label, mean, p99 in points:
            color = "tab:blue" if label.startswith("fcfs-wait") else "tab:orange" if label.startswith("age") else "tab:gray"
            marker = "*" if "default" in label else "o"
            ax.scatter([p99], [mean], color=color, marker=marker, s=160 if marker == "*" else 40, zorder=2)
            ax.annotate(label.replace(" (default)", "*"), (p99, mean), fontsize=7, xytext=(4, 3), textcoords="offset points")
        ax.axvline(1.0, color="black", lw=0.8)
        ax.axvline(1.2, color="black", lw=0.8, ls="--")
        ax.axhline(0.6, color="black", lw=0.8, ls="--")
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_title(f"{trace}, {results.top[trace]:g} qps ({results.label})")
        ax.set_xlabel("p99 end-to-end / INFERCEPT's")
        ax.set_ylabel("mean end-to-end / INFERCEPT's")
    fig.suptitle("MARS starvation variants at the most loaded point: lower left is better")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def size_spread(trace: str) -> float:
    """The coefficient of variation of the tokens the engine computes per request over the bundled
    trace's requests (prompt, outputs, and returns that another segment follows): what ordering
    by size has to work with."""
    import numpy as np

    from marsched.policy.fcfs_wait import predicted_work_tokens
    from marsched.predict.segment import SegmentPredictor
    from marsched.workload.loader import load_trace

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the multi trace's negative returns, read as 0: not news here
        requests = load_trace(trace)
    truth = SegmentPredictor.oracle()  # exact predictions: the work the FCFS wait estimate counts, as it is
    tokens = np.array([predicted_work_tokens(r.prompt_tokens, [truth.predict(r, i) for i in range(len(r.segments))])
                       for r in requests])
    return float(tokens.std() / tokens.mean())


def seeds_table(results: SetResults, traces: list[str]) -> None:
    """Per trace and seed at the most loaded point: INFERCEPT's mean, then MARS (default), MARS with
    no starvation prevention, SJF and the bound over it (mean / p99), and the median over the seeds."""
    rows = []
    for trace in traces:
        ratios: dict[str, list[tuple[float, float]]] = {"mars": [], "off": [], "sjf": [], "bound": []}
        for seed in results.seeds:
            main = results.load(f"seeds/{trace}-seed{seed}")
            infercept, mars = _by(main, "infercept").get(results.top[trace]), _by(main, "mars").get(results.top[trace])
            off = _by(results.load(f"seeds/{trace}-off-seed{seed}"), "mars").get(results.top[trace])
            sjf = _by(results.load(f"seeds/{trace}-sjf-seed{seed}"), "sjf").get(results.top[trace])
            bound = _by(results.load(f"seeds/{trace}-bound-seed{seed}"), "mars").get(results.top[trace])
            if infercept is None or None in (mars, off, sjf, bound):
                continue
            cells = []
            for name, r in (("mars", mars), ("off", off), ("sjf", sjf), ("bound", bound)):
                pair = (r["e2e_mean_s"] / infercept["e2e_mean_s"], r["e2e_p99_s"] / infercept["e2e_p99_s"])
                ratios[name].append(pair)
                cells.append(f"{pair[0]:.3f} / {pair[1]:.2f}")
            rows.append(f"| {trace} {results.top[trace]:g} qps | {seed} | {infercept['e2e_mean_s']:.1f} | " + " | ".join(cells) + " |")
        if ratios["mars"]:
            medians = [f"{statistics.median(m for m, _ in v):.3f} / {statistics.median(p for _, p in v):.2f}"
                       for v in ratios.values()]
            rows.append(f"| {trace} {results.top[trace]:g} qps | median of {len(ratios['mars'])} | | " + " | ".join(medians) + " |")
    if rows:
        print("\n| point | seed | infercept mean s | mars (default): mean / p99 over INFERCEPT's | "
              "mars, starvation off | sjf, predicted-peak | bound: mars told the future |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        print("\n".join(rows))
        print("\nSpread of request sizes (coefficient of variation of the tokens computed per request): "
              + ", ".join(f"{trace} {size_spread(trace):.2f}" for trace in traces))


def print_tables(results: SetResults, traces: list[str]) -> None:
    """Every table of the run set for these traces, then the frontier plot in its folder."""
    for trace in traces:
        main_table(results, trace)
    code_table(results, traces)
    for trace in traces:
        ablation_table(results, trace)
    frontier_table(results, traces)
    frontier_plot(results, traces, results.folder / "frontier.png")
    seeds_table(results, traces)

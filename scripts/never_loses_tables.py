"""Print the README's tables from results/never-loses/*.json (written by scripts/never_loses.sh)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent.parent / "results" / "never-loses"


def _load(name: str) -> list[dict]:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else []


def _by(records: list[dict], policy: str) -> dict[float, dict]:
    return {r["qps"]: r for r in records if r["policy"] == policy}


def main_table(trace: str) -> None:
    main = _load(f"{trace}-main")
    if not main:
        return
    vllm, infercept, mars = _by(main, "vllm"), _by(main, "infercept"), _by(main, "mars")
    noisy = {s: _by(_load(f"{trace}-noisy{s}"), "mars") for s in ("0.3", "0.6")}
    print(f"\n**{trace}** (mean / p99 end-to-end s; ratios are MARS over INFERCEPT)\n")
    print("| qps | vllm | infercept | mars | mean ratio | p99 ratio | mars max wait s | noisy:0.3 mean ratio | noisy:0.6 mean ratio |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
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
        print("| " + " | ".join(cells) + " |")


def ablation_table(trace: str) -> None:
    infercept = _by(_load(f"{trace}-main"), "infercept")
    variants = [("age + predicted-peak (default)", f"{trace}-main"), ("published + predicted-peak", f"{trace}-published"),
                ("iterations + predicted-peak", f"{trace}-iterations"), ("off + predicted-peak", f"{trace}-off"),
                ("age + greedy", f"{trace}-age-greedy"), ("published + greedy", f"{trace}-published-greedy"),
                ("iterations + greedy (0.1 default)", f"{trace}-iterations-greedy"), ("off + greedy", f"{trace}-off-greedy")]
    rows = [(label, _by(_load(name), "mars")) for label, name in variants]
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


def threshold_table(traces: list[str]) -> None:
    top = {"single": 16.0, "multi": 3.0, "agent": 0.4}  # the most loaded point of scripts/never_loses.sh
    rows = []
    for trace in traces:
        infercept = _by(_load(f"{trace}-main"), "infercept").get(top[trace])
        if infercept is None:
            continue
        cells = []
        for threshold, name in ((5, f"{trace}-age5"), (15, f"{trace}-main"), (30, f"{trace}-age30"), (60, f"{trace}-age60"),
                                (120, f"{trace}-age120"), (240, f"{trace}-age240")):
            r = _by(_load(name), "mars").get(top[trace])
            cells.append(f"{r['e2e_mean_s'] / infercept['e2e_mean_s']:.2f} / {r['e2e_p99_s'] / infercept['e2e_p99_s']:.2f}"
                         if r else "")
        rows.append(f"| {trace} {top[trace]:g} qps | " + " | ".join(cells) + " |")
    if rows:
        print("\n| `age` threshold (s) | 5 | 15 (default) | 30 | 60 | 120 | 240 |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        print("\n".join(rows))


if __name__ == "__main__":
    traces = sys.argv[1:] or ["single", "multi", "agent"]
    for trace in traces:
        main_table(trace)
    for trace in traces:
        ablation_table(trace)
    threshold_table(traces)

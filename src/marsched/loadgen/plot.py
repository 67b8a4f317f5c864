"""The replay's picture: latency distributions and each turn's latency over the run, from the JSON report."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from marsched.atomic import write_atomically


def _cdf(ax: Any, values: list[float], label: str) -> None:
    if values:
        data = np.sort(values)
        ax.step(data, np.arange(1, data.size + 1) / data.size, where="post", label=f"{label} (n={data.size})")


def plot_report(report: dict[str, Any], path: str | Path) -> None:
    """Three panels: CDFs of turn latency and TTFT (first turns, follow-ups); CDF of conversation
    latency; each turn's latency against when it was sent, failed turns marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    turns = [t for c in report["records"] for t in c["turns"]]
    done = [t for t in turns if t["error"] is None and t["latency_s"] is not None]
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(15, 4.2))
    _cdf(left, [t["latency_s"] for t in done], "turn latency")
    _cdf(left, [t["ttft_s"] for t in done if t["index"] == 0 and t["ttft_s"] is not None], "TTFT, first turns")
    _cdf(left, [t["ttft_s"] for t in done if t["index"] > 0 and t["ttft_s"] is not None], "TTFT, follow-ups")
    left.set(xscale="log", xlabel="seconds", ylabel="fraction of turns", title="turns")
    left.xaxis.set_minor_formatter(NullFormatter())  # minor labels of a short log axis overlap
    _cdf(middle, [c["e2e_s"] for c in report["records"] if c["e2e_s"] is not None], "conversation latency")
    middle.set(xlabel="seconds (tool gaps included)", ylabel="fraction of conversations", title="conversations")
    right.scatter([t["sent_s"] for t in done], [t["latency_s"] for t in done], s=6, label="finished")
    failed = [t for t in turns if t["error"] is not None]
    if failed:
        right.scatter([t["sent_s"] for t in failed], [0.0] * len(failed), s=12, marker="x", color="red",
                      label=f"failed (n={len(failed)})")
    right.set(xlabel="sent at (s since start)", ylabel="turn latency (s)", title="over the run")
    for ax in (left, middle, right):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    settings = report["settings"]
    title = (f"marsched loadgen: {settings['workload']} at {settings['rate']:g} conversations/s for "
             f"{settings['duration_s']:g} s, {report['server'].get('model', '?')}"
             + (" (interrupted)" if report["interrupted"] else ""))
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    try:
        write_atomically(path, lambda f: fig.savefig(f, format="png", dpi=110))
    finally:
        plt.close(fig)

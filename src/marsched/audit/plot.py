"""`marsched plot`: pictures of a run (from its trace) and of latency distributions (from metrics)."""

from __future__ import annotations

import os

from marsched.atomic import write_atomically
from marsched.audit.timeline import QUEUES, State, Timeline

COLOURS = {
    State.WAITING: "#c7c7c7",
    State.RUNNING: "#1f77b4",
    State.CALL_PRESERVE: "#2ca02c",
    State.CALL_DISCARD: "#d62728",
    State.CALL_SWAP: "#ff7f0e",
    State.CALL_TRAILING: "#8c564b",
    State.SWAP_OUT: "#9467bd",
    State.SWAP_IN: "#e377c2",
    State.SWAPPED: "#f5d033",
}
QUEUE_COLOURS = {"waiting": "#7f7f7f", "running": "#1f77b4", "paused": "#2ca02c", "swapped": "#ff7f0e"}
QUEUE_LABELS = {"waiting": "waiting", "running": "running", "paused": "in an API call", "swapped": "swapped, queued"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_trace(timeline: Timeline, path: str | os.PathLike[str], max_requests: int = 40) -> None:
    """Queue lengths and KV blocks over time, and the first `max_requests` requests' timelines."""
    plt = _pyplot()
    from matplotlib.patches import Patch

    shown = timeline.requests[:max_requests]
    height = 3.2 + 0.16 * len(shown)
    figure, axes = plt.subplots(3, 1, figsize=(12, 4.6 + height), sharex=True,
                                gridspec_kw={"height_ratios": [2.2, 2.2, height]})
    queues, memory, requests = axes
    for queue in QUEUES:
        queues.step(timeline.times, timeline.queues[queue], where="post", label=QUEUE_LABELS[queue],
                    color=QUEUE_COLOURS[queue], linewidth=1.2)
    queues.set_ylabel("requests")
    queues.set_title("queue lengths")
    queues.legend(loc="upper right", ncols=4, fontsize=8)

    memory.step(timeline.times, timeline.kv_device, where="post", label="device", color="#1f77b4", linewidth=1.2)
    memory.step(timeline.times, timeline.kv_host, where="post", label="host", color="#ff7f0e", linewidth=1.2)
    memory.axhline(timeline.device_blocks, color="#1f77b4", linestyle="--", linewidth=0.8,
                   label=f"device capacity ({timeline.device_blocks})")
    if timeline.host_blocks:
        memory.axhline(timeline.host_blocks, color="#ff7f0e", linestyle="--", linewidth=0.8,
                       label=f"host capacity ({timeline.host_blocks})")
    memory.set_ylabel("KV blocks in use")
    memory.set_title("KV cache memory")
    memory.legend(loc="upper right", ncols=4, fontsize=8)

    row = {rid: i for i, rid in enumerate(shown)}
    by_state: dict[State, list[tuple[int, float, float]]] = {}
    for span in timeline.spans:
        if span.rid in row:
            by_state.setdefault(span.state, []).append((row[span.rid], span.start, span.end - span.start))
    for state, bars in by_state.items():
        for index, start, width in bars:
            requests.broken_barh([(start, width)], (index - 0.4, 0.8), facecolors=COLOURS[state])
    labels = [rid if len(rid) <= 16 else rid[:7] + "…" + rid[-8:] for rid in shown]  # hashes: both ends
    requests.set_yticks(range(len(shown)), labels, fontsize=7 if len(shown) > 20 else 8)
    requests.set_ylim(len(shown) - 0.5, -0.5)
    requests.set_xlabel("engine time (s)")
    requests.set_title(f"requests (first {len(shown)} of {len(timeline.requests)} by arrival)", pad=24)
    requests.legend(handles=[Patch(color=COLOURS[s], label=s.value) for s in State],
                    loc="lower center", bbox_to_anchor=(0.5, 1.0), ncols=len(State), fontsize=7.5, frameon=False,
                    handlelength=1.2, columnspacing=1.0)
    for axis in axes:
        axis.grid(alpha=0.3)
    figure.suptitle(f"{timeline.policy} on {timeline.engine}: {len(timeline.requests)} requests, "
                    f"{timeline.end - timeline.start:.1f} s")
    figure.tight_layout()
    write_atomically(path, lambda f: figure.savefig(f, format="png", dpi=110))
    plt.close(figure)


def plot_cdfs(records: list[dict], path: str | os.PathLike[str]) -> None:
    """End-to-end latency and time-to-first-token CDFs, one line per record (policy, load)."""
    plt = _pyplot()
    figure, axes = plt.subplots(1, 2, figsize=(12, 4.4))
    several_loads = len({r.get("qps") for r in records}) > 1
    for record in records:
        label = record.get("policy", "?") + (f" @ {record['qps']:g} qps" if several_loads and "qps" in record else "")
        for axis, key in zip(axes, ("e2e_cdf_s", "ttft_cdf_s")):
            values = record[key]
            axis.plot(values, [i / (len(values) - 1) for i in range(len(values))], label=label)
    for axis, title in zip(axes, ("end-to-end latency", "time to first token")):
        axis.set_xlabel("seconds")
        axis.set_ylabel("fraction of requests")
        low = min(min(r[key]) for r in records for key in ("e2e_cdf_s", "ttft_cdf_s"))
        axis.set_xscale("log" if low > 0 else "symlog", **({} if low > 0 else {"linthresh": 0.01}))
        axis.set_title(title)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    first = records[0]
    loads = "" if several_loads or "qps" not in first else f" @ {first['qps']:g} qps"
    figure.suptitle(" · ".join(str(first[k]) for k in ("engine", "profile", "trace") if k in first) + loads)
    figure.tight_layout()
    write_atomically(path, lambda f: figure.savefig(f, format="png", dpi=110))
    plt.close(figure)

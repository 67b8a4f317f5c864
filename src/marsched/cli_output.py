"""What the `marsched` commands print: the two consoles, the progress bar, trace warnings once, and
the results table of `simulate` and `compare`."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.measure import Measurement
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from marsched.workload.errors import TraceWarning

# Wide enough for the comparison table when output goes to a file or a pipe.
console = Console(width=None if sys.stdout.isatty() else 150)
errors = Console(stderr=True)


def progress() -> Progress:
    """A bar on stderr, shown only on a terminal and gone when done."""
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=errors, transient=True, disable=not sys.stderr.isatty())


@contextmanager
def trace_warnings_once() -> Iterator[None]:
    """Print each distinct TraceWarning once, as one line on stderr, however often the trace is loaded.

    A run loads its trace more than once (here to fail early, again in each worker);
    workers forked from this process inherit the set of warnings already shown.
    """
    shown: set[str] = set()
    default_show = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        if not issubclass(category, TraceWarning):
            default_show(message, category, filename, lineno, file, line)
        elif str(message) not in shown:
            shown.add(str(message))
            errors.print(f"[bold yellow]warning:[/] {escape(str(message))}", highlight=False, soft_wrap=True,
                         emoji=False)

    with warnings.catch_warnings():  # restores the filters and showwarning afterwards
        warnings.simplefilter("always", TraceWarning)
        warnings.showwarning = show
        yield


# --- the results table -----------------------------------------------------------------------

_COLUMNS = ("qps", "policy", "e2e mean", "e2e p50", "e2e p99", "ttft mean", "ttft p99",
            "× isolated", "slowdown p99", "max wait", "preempt", "strategies", "finished")
_LATENCY = _COLUMNS[:9]
_LEFT = ("policy", "strategies")


def strategy_cells(counts: dict[str, int]) -> str:
    """`P3 D1 S0`: each strategy's initial and count."""
    return " ".join(f"{k[0].upper()}{v}" for k, v in counts.items())


def _cells(r: dict) -> dict[str, str]:
    return {
        "qps": f"{r['qps']:g}", "policy": r["policy"], "e2e mean": f"{r['e2e_mean_s']:.2f}",
        "e2e p50": f"{r['e2e_p50_s']:.2f}", "e2e p99": f"{r['e2e_p99_s']:.2f}", "ttft mean": f"{r['ttft_mean_s']:.3f}",
        "ttft p99": f"{r['ttft_p99_s']:.3f}", "× isolated": f"{r['e2e_mean_s'] / r['isolated_e2e_mean_s']:.3f}",
        "slowdown p99": f"{r['slowdown_p99']:.1f}" if "slowdown_p99" in r else "–",
        "max wait": f"{r['max_queue_wait_s']:.1f}", "preempt": str(r["preemptions"]),
        "strategies": strategy_cells(r["strategy_counts"]), "finished": f"{r['num_finished']}/{r.get('num_measured', r['num_requests'])}",
    }


def _build_table(title: str, columns: tuple[str, ...], rows: list[dict[str, str]]) -> Table:
    # The title folds rather than ending in "...": it may name the trace and its token scale.
    table = Table(title=Text(title, overflow="fold"), header_style="bold", box=box.SIMPLE_HEAD, pad_edge=False,
                  padding=(0, 0, 0, 1))
    for column in columns:
        # Never narrower than the longest word of a cell: a number is shown whole or not at all
        # (`_tables` splits the table instead); headers and strategies wrap at spaces.
        words = [w for row in rows for w in row[column].split()] or [""]
        table.add_column(column, justify="left" if column in _LEFT else "right", overflow="fold",
                         min_width=max(len(w) for w in words))
    for row in rows:
        table.add_row(*(row[c] for c in columns))
    return table


def _tables(records: list[dict], width: int) -> list[Table]:
    """The results: one table, or two (latency; queueing and memory) when one does not fit `width`."""
    rows = [_cells(r) for r in records]
    title = "end-to-end latency (s), time to first token (s)"
    scales = sorted({r.get("token_scale", 1.0) for r in records})
    if scales != [1.0]:  # the trace's lengths were scaled: say so wherever the numbers go
        title += f" · {Path(records[0]['trace']).name} tokens × {', '.join(f'{f:g}' for f in scales)}"
    whole = _build_table(title, _COLUMNS, rows)
    if Measurement.get(console, console.options.update(width=10_000), whole).maximum <= width:
        return [whole]
    rest = ("qps", "policy") + tuple(c for c in _COLUMNS if c not in _LATENCY)
    return [_build_table(title, _LATENCY, rows),
            _build_table("queueing (max wait, s) and memory (preemptions, strategies)", rest, rows)]


def print_results(records: list[dict], policies: list[str]) -> None:
    """Rows in the order the policies were given, then by QPS."""
    order = {name: index for index, name in enumerate(policies)}
    records = sorted(records, key=lambda r: (order.get(r["policy"], len(order)), r["qps"]))
    for table in _tables(records, console.width):
        console.print(table)

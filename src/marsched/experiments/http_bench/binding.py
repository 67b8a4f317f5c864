"""The CPU cores a server's engine computes on, read from its log, and the check that every
configuration got the same ones: a comparison on different cores measures the cores.

vLLM's CPU build logs its OpenMP binding once at start (`vllm.utils.ompmultiprocessing`): a
block with ``local_rank=R, core ids=[...]`` per rank and ``reserved_cpus=[...]``. The binding
is those lines, in order, joined by "; ". On a GPU there is no such block: the binding is None
for every server, and None for all is alike.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

_LINE = re.compile(r"(local_rank=\d+, core ids=\[[^\]]*\]|reserved_cpus=\[[^\]]*\])")


class BindingMismatch(RuntimeError):
    """Two servers computed on different cores; the message names each binding and its runs."""


def core_binding(log_text: str) -> str | None:
    """The first binding block of a server's log, or None when it has none (yet)."""
    found: list[str] = []
    for line in log_text.splitlines():
        match = _LINE.search(line)
        if match:
            found.append(match.group(1))
            if match.group(1).startswith("reserved_cpus"):  # the block's last line
                return "; ".join(found)
    return "; ".join(found) if found else None


def check_same_binding(bindings: Mapping[str, str | None]) -> None:
    """BindingMismatch unless every run (label -> binding) has the same binding."""
    runs_of: dict[str | None, list[str]] = {}
    for label, binding in bindings.items():
        runs_of.setdefault(binding, []).append(label)
    if len(runs_of) > 1:
        lines = [f"  {binding if binding is not None else '(no binding in the log)'}: {', '.join(labels)}"
                 for binding, labels in runs_of.items()]
        raise BindingMismatch("the servers computed on different CPU cores, so their numbers do not compare:\n"
                              + "\n".join(lines))

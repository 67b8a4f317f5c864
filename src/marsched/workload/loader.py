"""One entry point for traces: a file path (format chosen by extension) or the name of the bundled trace."""

from __future__ import annotations

import os
from importlib.resources import files
from importlib.resources.abc import Traversable
from pathlib import Path

from marsched.workload.errors import TraceError
from marsched.workload.infercept_json import load_infercept_json, parse_infercept_json
from marsched.workload.jsonl import load_jsonl
from marsched.workload.model import Request

BUNDLED_FILE = "infercept_single_api.json"
# Names that mean the bundled trace; the repository keeps the same file in data/workloads/.
BUNDLED_NAMES = frozenset({"bundled", "infercept_single_api", BUNDLED_FILE})

_LOADERS = {".json": load_infercept_json, ".jsonl": load_jsonl}


def bundled_trace() -> Traversable:
    """The bundled INFERCEPT single-API trace, shipped as package data (found in any install)."""
    return files("marsched.workload") / "data" / BUNDLED_FILE


def load_bundled() -> list[Request]:
    """The bundled trace's 397 requests."""
    resource = bundled_trace()
    return parse_infercept_json(resource.read_bytes(), source=str(resource))


def load_trace(path_or_name: str | os.PathLike[str]) -> list[Request]:
    """Requests from a trace file (.json: INFERCEPT/MARS, .jsonl: marsched) or the name ``bundled``."""
    if isinstance(path_or_name, str) and path_or_name in BUNDLED_NAMES:
        return load_bundled()
    path = Path(path_or_name)
    loader = _LOADERS.get(path.suffix.lower())
    if loader is None:
        known = ", ".join(sorted(_LOADERS))
        raise TraceError(
            path,
            "file",
            None,
            f"unknown trace format {path.suffix or '(no extension)'!r}: expected {known}, or the name 'bundled'",
        )
    return loader(path)

"""Engines and servers shared by the tests of a session, one per configuration.

Starting a vLLM engine costs more than most of the tests that use it: an AsyncLLM starts an
engine-core process that imports vLLM, a `marsched serve` three such processes one after
the other. Each is mostly one core's work, so the pool starts every configuration the
collected tests need at once, when the session starts, and the tests before theirs run
meanwhile on the other core. conftest.py hands each out as a session fixture of its name and
stops it after the last test that uses it.

A shared thing is built by `factory(model, folder)`, which starts it without waiting, and
has `wait_ready()` (raises if it did not start) and `close()` (idempotent).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable


class SharedPool:
    def __init__(self, factories: dict[str, Callable[[str, Path], Any]], model: str,
                 folder_for: Callable[[str], Path], needed: set[str]) -> None:
        self.factories, self.model, self.folder_for, self.needed = factories, model, folder_for, needed
        self.started: dict[str, Any] = {}
        self.closed: set[str] = set()

    def start(self, names: set[str] | None = None) -> None:
        """Start those of `names` (default: all needed) not started yet, without waiting for them."""
        for name in sorted(self.needed if names is None else names):
            if name not in self.started and name not in self.closed:
                self.started[name] = self.factories[name](self.model, self.folder_for(name))

    def get(self, name: str) -> Any:
        assert name not in self.closed, f"{name} was stopped after what was taken as its last test"
        self.start(self.needed | {name})
        shared = self.started[name]
        shared.wait_ready()
        return shared

    def stop(self, name: str) -> None:
        shared = self.started.pop(name, None)
        self.closed.add(name)
        if shared is not None:
            shared.close()

    def close(self) -> None:
        for name in list(self.started):
            self.stop(name)

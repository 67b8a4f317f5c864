"""Engines, servers and commands shared by the tests of a session, one per configuration.

Starting a vLLM engine costs more than most of the tests that use it: an AsyncLLM starts an
engine-core process that imports vLLM, a `marsched serve` two or three such processes one
after the other. Each start is mostly one core's work, so when the session starts the pool
starts every configuration the collected tests need, in the order the tests first use them,
one after the other in a background thread per lane: the engines and servers in one, while the
tests before theirs run on the other core; the commands, which only the session's last tests
read, in another, so that they run beside the rest rather than after it. A test that needs one
sooner starts it at once. conftest.py hands each out as a session
fixture of its name and stops it after the last test that uses it.

A shared thing is built by `factory(model, folder)`, which starts it without waiting, and has
`wait_ready()` (raises if it did not start; may be called again; a command's returns when it has
run) and `close()` (idempotent).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Callable


class SharedPool:
    def __init__(self, factories: dict[str, Callable[[str, Path], Any]], model: str,
                 folder_for: Callable[[str], Path], lanes: list[list[str]]) -> None:
        self.factories, self.model, self.folder_for, self.lanes = factories, model, folder_for, lanes
        self.started: dict[str, Any] = {}
        self.closed: set[str] = set()
        self._lock = threading.Lock()
        self._background: list[threading.Thread] = []

    def _start(self, name: str) -> Any:
        """`name`'s shared thing, started now unless it was already; None once stopped."""
        with self._lock:
            if name in self.closed:
                return None
            if name not in self.started:
                self.started[name] = self.factories[name](self.model, self.folder_for(name))
            return self.started[name]

    def start_in_background(self) -> None:
        def one_after_another(lane: list[str]):
            for name in lane:
                shared = self._start(name)
                try:
                    if shared is not None:
                        shared.wait_ready()
                except BaseException:  # noqa: BLE001 - raised again to the tests that get it
                    pass

        for i, lane in enumerate(self.lanes):
            thread = threading.Thread(target=one_after_another, args=(lane,), name=f"shared-start-{i}", daemon=True)
            thread.start()
            self._background.append(thread)

    def get(self, name: str) -> Any:
        shared = self._start(name)
        assert shared is not None, f"{name} was stopped after what was taken as its last test"
        shared.wait_ready()
        return shared

    def stop(self, name: str) -> None:
        with self._lock:
            shared = self.started.pop(name, None)
            self.closed.add(name)
        if shared is not None:
            shared.close()

    def close(self) -> None:
        with self._lock:
            self.closed.update(name for lane in self.lanes for name in lane)
        for name in list(self.started):
            self.stop(name)

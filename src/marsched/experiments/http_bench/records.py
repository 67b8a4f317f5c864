"""What one run leaves behind: its configuration and repeat, where its files are, the server's
core binding, queue and counters, and what went wrong, if anything."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(slots=True)
class RunRecord:
    config: str
    repeat: int
    loadgen: str | None = None  # the loadgen JSON report's path, once written
    log: str | None = None  # the server's log
    command: list[str] = field(default_factory=list)
    binding: str | None = None  # `binding.core_binding` of the log
    queue: dict[str, Any] | None = None  # `engine_queue.QueueStats`
    counters: dict[str, Any] = field(default_factory=dict)  # retention and prefix-cache counters after the load
    cost_model: dict[str, Any] | None = None  # the server's learned cost model after the load: a marsched server's
    # (`conversations.servers.cost_model_of`), or stock vLLM's step meter's (`metered_cost_model`)
    start_s: float | None = None  # until the server was healthy
    load_s: float | None = None  # the replay's wall time
    interrupted: bool = False  # Ctrl-C during the replay: its report holds only what finished
    error: str | None = None  # the run did not measure (the server did not start, loadgen refused it)

    @property
    def measured(self) -> bool:
        """Whether the run counts in the summary: a complete replay with its report."""
        return self.loadgen is not None and self.error is None and not self.interrupted

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> RunRecord:
        return cls(**values)

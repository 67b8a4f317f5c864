"""The engine's state that policy decisions depend on."""

from dataclasses import dataclass


@dataclass(slots=True)  # not frozen: built at every push and step, and frozen ones build 4x slower
class EngineLoad:
    now_s: float
    running_kv_tokens: int  # K: KV tokens held by the running batch
    iteration_s: float  # the engine's current time per iteration (τ)
    host_free_tokens: int  # room left in host memory for swapped KV
    kv_capacity_tokens: int = 0  # the device's KV capacity (0: not given; the Boost order needs it)

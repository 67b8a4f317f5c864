"""How `marsched bench` and `marsched calibrate` size and configure the vLLM engine they start.

`plan_engine` fixes, before the engine starts, its dtype, its max model length (the
smallest of the model's `max_position_embeddings`, what the KV cache holds for one request
alone, and `--max-model-len`) and its KV cache (a block count from `--kv-cache-gb`, or
`VLLM_CPU_KVCACHE_SPACE`); `engine_kwargs` turns the plan into vLLM's engine arguments. What
the engine really got is read back from vLLM after it starts.

CUDA graphs: on vLLM's CPU platform the engine runs eagerly (it has no graphs to capture); on a
GPU it keeps vLLM's default, CUDA graphs captured at start, as a user's engine runs
(`enforce_eager`). The step times measured are then those of the engine users run.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from typing import Any

from marsched.bench.model import ModelInfo
from marsched.bench.options import check_kv_cache_gb

BLOCK_TOKENS = 128  # vLLM's default block size on the CPU; blocks are counted in it
KV_SPACE_VAR = "VLLM_CPU_KVCACHE_SPACE"  # GiB of KV cache on vLLM's CPU build
_GIB = 1 << 30


def kv_blocks_for(gib: float, kv_bytes_per_token: int, block_tokens: int = BLOCK_TOKENS) -> int:
    """Blocks of `block_tokens` tokens that `gib` GiB of KV cache hold (vLLM's num_gpu_blocks)."""
    check_kv_cache_gb(gib)
    blocks = int(gib * _GIB // (kv_bytes_per_token * block_tokens))
    if blocks < 2:
        raise ValueError(f"--kv-cache-gb {gib:g}: holds {blocks} block(s) of {block_tokens} tokens "
                         f"({kv_bytes_per_token} bytes per token); give at least "
                         f"{2 * kv_bytes_per_token * block_tokens / _GIB:.4f}")
    return blocks


@dataclass(frozen=True, slots=True)
class EnginePlan:
    """How the engine is sized before it starts (capacity is read back from vLLM after)."""

    dtype: str
    max_model_len: int
    num_gpu_blocks: int | None  # None: vLLM sizes the cache from VLLM_CPU_KVCACHE_SPACE
    kv_space_gib: int | None  # VLLM_CPU_KVCACHE_SPACE to set (integer GiB), None: the one set

    def engine_model(self, model: ModelInfo) -> ModelInfo:
        """The model as the engine runs it (in the plan's dtype: its KV bytes per token)."""
        return replace(model, dtype=self.dtype)


def plan_engine(model: ModelInfo, *, dtype: str = "auto", kv_cache_gb: float | None = None,
                max_model_len: int | None = None) -> EnginePlan:
    """The plan for `model` run in `dtype` (auto: the model's own), with `kv_cache_gb` GiB of KV cache
    (None: VLLM_CPU_KVCACHE_SPACE as set, else 1 GiB) and at most `max_model_len` tokens per request."""
    dtype = model.dtype if dtype == "auto" else dtype
    if dtype == "float16":
        dtype = "bfloat16"  # vLLM's CPU build runs half precision as bf16
    limit = model.max_position
    blocks = None
    # Without a size vLLM's CPU build reserves 92% of the machine's memory for the KV cache
    # (gpu_memory_utilization) and refuses to start when less is free: default to 1 GiB.
    space = None if KV_SPACE_VAR in os.environ else 1
    if kv_cache_gb is not None:
        blocks = kv_blocks_for(kv_cache_gb, replace(model, dtype=dtype).kv_bytes_per_token)
        space = max(1, math.ceil(kv_cache_gb))
        limit = min(limit, (blocks - 1) * BLOCK_TOKENS)  # one request must fit alone; one block is vLLM's null
    if max_model_len is not None:
        limit = min(limit, max_model_len)
    return EnginePlan(dtype, limit, blocks, space)


def set_engine_environment(plan: EnginePlan, variables: dict[str, str]) -> dict[str, str | None]:
    """Set what the engine core reads from the environment when it starts: `variables` (the step
    log's path) and the plan's VLLM_CPU_KVCACHE_SPACE. Returns the values before, to restore."""
    saved = {name: os.environ.get(name) for name in (*variables, KV_SPACE_VAR)}
    os.environ.update(variables)
    if plan.kv_space_gib is not None:
        os.environ[KV_SPACE_VAR] = str(plan.kv_space_gib)
    return saved


def restore_environment(saved: dict[str, str | None]) -> None:
    """Put back what `set_engine_environment` changed (None: the variable was not set)."""
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def enforce_eager(platform: Any = None) -> bool:
    """Whether the engine must run eagerly: on vLLM's CPU platform (no CUDA graphs there) only.
    `platform`: vLLM's `current_platform` unless given."""
    if platform is None:
        from vllm.platforms import current_platform as platform
    return bool(platform.is_cpu())


def engine_kwargs(plan: EnginePlan, seed: int, platform: Any = None) -> dict[str, Any]:
    """vLLM's engine arguments for the plan: dtype, block size, max model length, KV blocks, seed."""
    kwargs: dict[str, Any] = {"dtype": plan.dtype, "enforce_eager": enforce_eager(platform),
                              "block_size": BLOCK_TOKENS, "max_model_len": plan.max_model_len, "seed": seed}
    if plan.num_gpu_blocks is not None:
        kwargs["num_gpu_blocks_override"] = plan.num_gpu_blocks
    return kwargs

"""What marsched's two host-memory KV connectors share: the Swap connector (`kv_swap`) and the
host prefix tier (`prefix_tier`).

Both copy whole device blocks to host memory and back with one `kv_copy.KvMover` per worker,
built from the KV tensors vLLM registers (`mover_for`), and read their options from
`kv_connector_extra_config` (`extra_config`), converting bytes to blocks with the engine's
KV-cache config (`bytes_per_block`).
"""

from __future__ import annotations

from typing import Any

import torch

from marsched.vllm.kv_copy import KvMover
from marsched.vllm.kv_copy_layout import resolve_layout


def extra_config(vllm_config: Any) -> dict[str, Any]:
    """The connector's `kv_connector_extra_config` (empty when none)."""
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    return dict(getattr(transfer, "kv_connector_extra_config", None) or {})


def bytes_per_block(kv_cache_config: Any) -> int:
    """KV bytes of one block over every layer, from the engine's KV-cache config."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    return sum(g.kv_cache_spec.page_size_bytes * len(g.layer_names) for g in groups)


def attention_backends(vllm_config: Any, layer_names: list[str]) -> dict[str, Any]:
    """Each layer's attention backend class, where vLLM can tell (for the KV layout)."""
    try:
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

        layers = get_layers_from_vllm_config(vllm_config, AttentionLayerBase, layer_names)
        return {name: layer.get_attn_backend() for name, layer in layers.items()}
    except Exception:  # noqa: BLE001 - no backend known: the layout falls back to vLLM's view contract
        return {}


def mover_for(vllm_config: Any, kv_caches: dict[str, torch.Tensor], num_blocks: int | None) -> KvMover | None:
    """The worker's mover over the registered KV caches (None: no KV cache, nothing to copy).
    A layer whose block dimension cannot be told stops the engine here, naming the layer."""
    if not kv_caches:
        return None
    backends = attention_backends(vllm_config, list(kv_caches))
    layouts = {name: resolve_layout(name, kv, num_blocks, backends.get(name)) for name, kv in kv_caches.items()}
    return KvMover(kv_caches, layouts)

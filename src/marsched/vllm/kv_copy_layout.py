"""Where the blocks are in a layer's KV-cache tensor: the block dimension, read from the layout.

Pure torch (no vLLM import), so that the copy path can be tested on bare tensors.

vLLM 0.32 hands a KV connector one view per layer (`register_kv_caches`), built by
`vllm.v1.worker.utils.allocate_kv_cache`: the logical shape is always `[B, H, N, C]`
(blocks, heads, states, content), and the physical order lives in the strides
(`KVCacheLayout.stride_order`: `LBHNC`, `LHBNC`, ...). B counts kernel blocks, a whole
multiple of the manager's `num_blocks` when the backend splits blocks (its
`group_kernel_blocks` views them back as `[num_blocks, ratio, ...]`; vLLM's offloading
worker reads the block dimension the same way). Older attention backends describe the
logical shape themselves (`get_kv_cache_shape(num_blocks, block_size, heads, head_size)`,
with the physical order in `get_kv_cache_stride_order`): there the block dimension is the
one that moves with `num_blocks`, found by asking for a shape with a marker block count,
as vLLM's offloading worker did for those backends.

The copies index the logical view, so any stride order works; the layout only has to say
which dimension holds blocks and how many kernel blocks make one manager block.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

# The sizes vLLM's offloading worker probed `get_kv_cache_shape` with: a block count that no
# other dimension a backend derives (2 for K/V, block size, heads, head size) can equal.
PROBE_BLOCKS = 1234
PROBE_BLOCK_SIZE = 16
PROBE_KV_HEADS = 8
PROBE_HEAD_SIZE = 256

# vLLM 0.32's per-layer view passed to KV connectors: [B, H, N, C], blocks first.
MANAGER_VIEW_DIMS = 4


class LayoutError(ValueError):
    """The block dimension of a layer's KV cache cannot be determined."""


@dataclass(frozen=True, slots=True)
class BlockLayout:
    """How one layer's KV-cache tensor holds blocks: dimension `block_dim` of the logical
    view, `kernel_blocks` consecutive entries of it per manager block."""

    block_dim: int
    kernel_blocks: int = 1
    source: str = ""  # how it was found, for error messages and logs

    def blocks_view(self, kv: torch.Tensor) -> torch.Tensor:
        """`kv` as `[manager blocks, ...]` (a view: writes go to `kv`)."""
        view = kv.movedim(self.block_dim, 0)
        if self.kernel_blocks > 1:
            view = view.unflatten(0, (-1, self.kernel_blocks))
        return view


def probe_block_dim(get_kv_cache_shape: Callable[..., tuple[int, ...]]) -> tuple[int, int] | None:
    """(block dimension, number of dimensions) of a backend's logical KV-cache shape, or None
    when the backend's shape does not show one dimension that moves with `num_blocks`."""
    try:
        shape = tuple(get_kv_cache_shape(PROBE_BLOCKS, PROBE_BLOCK_SIZE, PROBE_KV_HEADS, PROBE_HEAD_SIZE))
    except (NotImplementedError, TypeError, ValueError, AssertionError):
        return None
    dims = [d for d, n in enumerate(shape) if n == PROBE_BLOCKS]
    return (dims[0], len(shape)) if len(dims) == 1 else None


def resolve_layout(name: str, kv: torch.Tensor, num_blocks: int, backend: Any = None) -> BlockLayout:
    """The block layout of layer `name`'s KV cache `kv` (`num_blocks` manager blocks).

    `backend`: the layer's attention backend class, when known. Its `get_kv_cache_shape`
    decides when it has one whose rank matches `kv`; otherwise `kv` must be vLLM 0.32's
    `[B, H, N, C]` view. Raises LayoutError naming the layer when neither holds."""
    if num_blocks is None or num_blocks <= 0:
        raise LayoutError(f"KV cache layer {name!r}: the number of blocks is unknown ({num_blocks!r}); "
                          "the Swap connector needs kv_cache_config.num_blocks")
    backend_name = getattr(backend, "__name__", None) or (backend.get_name() if hasattr(backend, "get_name") else None)
    shape_fn = getattr(backend, "get_kv_cache_shape", None)
    probed = probe_block_dim(shape_fn) if callable(shape_fn) else None
    if probed is not None and probed[1] == kv.dim():
        layout = BlockLayout(probed[0], source=f"{backend_name}.get_kv_cache_shape: dimension {probed[0]}")
    elif kv.dim() == MANAGER_VIEW_DIMS:
        layout = BlockLayout(0, source="vLLM's [B, H, N, C] per-layer view: dimension 0")
    else:
        told = f" (backend {backend_name})" if backend_name else ""
        raise LayoutError(f"KV cache layer {name!r}{told}: shape {tuple(kv.shape)} is neither vLLM's "
                          f"[blocks, heads, states, content] view nor the backend's get_kv_cache_shape; "
                          "cannot tell which dimension holds blocks")
    size = kv.shape[layout.block_dim]
    if size % num_blocks:
        raise LayoutError(f"KV cache layer {name!r}: dimension {layout.block_dim} ({layout.source}) has {size} "
                          f"entries, not a multiple of the engine's {num_blocks} blocks (shape {tuple(kv.shape)})")
    return BlockLayout(layout.block_dim, size // num_blocks, layout.source)

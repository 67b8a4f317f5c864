"""Time the Swap link through the connector's own copy path (`marsched calibrate`'s time_swap) on
this machine's device: a Llama-3-8B-shaped KV cache (32 layers, 8 KV heads, head size 128, bf16,
128-token blocks). COUNTS (environment) sets the block counts, default 1,8,64,256; the cache
holds four times the largest, 16 GiB at the default."""

import json
import os

import torch

from marsched.bench.calibrate import time_swap
from marsched.bench.engine_config import BLOCK_TOKENS
from marsched.bench.model import ModelInfo

if __name__ == "__main__":
    model = ModelInfo("llama3-8b-shape", 32, 8, 128, "bfloat16", 8192, 128256, "llama3-8b-shape")
    counts = tuple(int(c) for c in os.environ.get("COUNTS", "1,8,64,256").split(","))
    out, back = time_swap(model, "bfloat16", counts, repeats=5, blocks_in_cache=4 * max(counts) + 1)
    per_block = model.kv_bytes_per_token * BLOCK_TOKENS
    rows = []
    for (n, o), (_, b) in zip(out, back):
        rows.append({"blocks": n, "bytes": n * per_block, "out_s": o, "in_s": b,
                     "out_GBps": n * per_block / o / 1e9, "in_GBps": n * per_block / b / 1e9})
        print(f"{n:4d} blocks ({n * per_block / 2**20:7.1f} MiB): out {o * 1e3:8.3f} ms ({rows[-1]['out_GBps']:6.1f} GB/s), "
              f"in {b * 1e3:8.3f} ms ({rows[-1]['in_GBps']:6.1f} GB/s)")
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    print(json.dumps({"device": device, "rows": rows}))

"""The H100 profiles' constants, derived: `c` and `a` from Vidur's published operator profiles,
`b` and `e` from the GPU's published bandwidth and attention throughput.

Vidur (microsoft/vidur@7d47513) publishes per-operator GPU times of transformer layers,
`data/profiling/compute/<gpu>/<model>/mlp.csv`: for each token count (1 to 4,096 on the H100)
and tensor-parallel degree, the median milliseconds of each operator of one layer. Its
attention kernels (`attention.csv`) are stored with Git LFS and are not in the repository's
files, and it has no H100 profile of Llama 3 (its README's table marks both ✗); so:

- `llama3-70b-4xh100`: Llama-2-70B's H100 rows at TP=4. Its layers are Llama-3-70B's layers
  (hidden 8192, 64 query and 8 KV heads of 128, MLP 28,672, 80 layers); only the vocabulary
  differs, and Vidur's layer operators do not include the LM head. Vidur adds two all-reduces
  of `tokens × hidden × 2` bytes per layer at TP > 1 (its `ExecutionTime`: one after attention,
  one after the MLP), each its measured NCCL time (`network/h100_dgx/all_reduce.csv`, 4 workers)
  plus its `nccl_cpu_launch_overhead_ms` of 0.02 ms.
- `llama3-8b-h100`: Llama-3-8B's A100 rows carried to the H100 operator by operator and token
  count, by the H100/A100 ratio of the same operator of Llama-2-7B (the model both GPUs have,
  same hidden size, heads and depth): `t_H100(L3, op, n) = t_A100(L3, op, n) ·
  t_H100(L2, op, n) / t_A100(L2, op, n)`.

One iteration's linear time is then `layers × Σ operators` (Vidur's `model_time`, attention
kernels aside), and `c + a·n` is fitted to it over Vidur's token counts, relative least squares
with both constants >= 0. `c` also gets the LM head's weight read, which Vidur does not profile
(vLLM computes logits only for each sequence's last token, so its per-token FLOPs are
negligible and its weight read is per step): `vocab × hidden × 2` bytes over the GPU's HBM
bandwidth, per tensor-parallel GPU.

`python -m marsched.bench.vidur_profile VIDUR_CHECKOUT` prints the derived constants.
"""

from __future__ import annotations

import csv
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from marsched.bench.fit import LineFit, fit_quality, nonnegative_least_squares

# One layer's operators other than the attention kernels, as Vidur sums them.
LAYER_OPERATORS = ("input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj", "post_attention_layernorm",
                   "mlp_up_proj", "mlp_act", "mlp_down_proj", "add")
NCCL_LAUNCH_MS = 0.02  # vidur/config/config.py: nccl_cpu_launch_overhead_ms
ALL_REDUCES_PER_LAYER = 2  # vidur/entities/execution_time.py: attention's and the MLP's
# NVIDIA H100 SXM5 datasheet: 3.35 TB/s HBM3.
H100_HBM_BYTES_PER_S = 3.35e12
# FlashAttention-3 (Shah et al. 2024, arXiv 2407.08608), Figure 4(e), forward, causal mask, head
# dim 128, H100 80GB SXM5: 602 TFLOPs/s at sequence length 8k (579 at 4k, 616 at 16k).
FA3_CAUSAL_FLOPS_PER_S = 602e12

Times = dict[int, dict[str, float]]  # token count -> operator -> median ms


def read_operator_times(path: Path, tensor_parallel: int) -> Times:
    """Vidur's `mlp.csv`: the median ms of each layer operator per token count at one TP degree
    (the median of the rows of a repeated count)."""
    rows: dict[int, dict[str, list[float]]] = {}
    with path.open(newline="") as handle:
        for line, row in enumerate(csv.DictReader(handle), start=2):
            try:
                if int(row["num_tensor_parallel_workers"]) != tensor_parallel:
                    continue
                tokens = int(row["num_tokens"])
                for op in LAYER_OPERATORS:
                    rows.setdefault(tokens, {}).setdefault(op, []).append(float(row[f"time_stats.{op}.median"]))
            except (KeyError, TypeError, ValueError) as error:
                raise ValueError(f"{path}: row {line}: {type(error).__name__} {error}") from None
    if not rows:
        raise ValueError(f"{path}: no rows with num_tensor_parallel_workers = {tensor_parallel}")
    return {n: {op: statistics.median(values) for op, values in ops.items()} for n, ops in sorted(rows.items())}


def transfer(target_elsewhere: Times, reference: Times, reference_elsewhere: Times) -> Times:
    """A model's times on the reference's GPU, from its times on another GPU: each operator at each
    token count all three tables have, scaled by the reference model's ratio between the GPUs."""
    common = sorted(set(target_elsewhere) & set(reference) & set(reference_elsewhere))
    return {n: {op: target_elsewhere[n][op] * reference[n][op] / reference_elsewhere[n][op] for op in LAYER_OPERATORS}
            for n in common}


def read_all_reduce(path: Path, workers: int) -> list[tuple[float, float]]:
    """Vidur's `all_reduce.csv`: (bytes, median ms) at `workers` GPUs of one node, by size."""
    sizes: dict[float, list[float]] = {}
    with path.open(newline="") as handle:
        for line, row in enumerate(csv.DictReader(handle), start=2):
            try:
                if int(row["num_workers"]) != workers or int(row["devices_per_node"]) != workers:
                    continue
                sizes.setdefault(float(row["size"]), []).append(float(row["time_stats.all_reduce.median"]))
            except (KeyError, TypeError, ValueError) as error:
                raise ValueError(f"{path}: row {line}: {type(error).__name__} {error}") from None
    if not sizes:
        raise ValueError(f"{path}: no all-reduce rows for {workers} workers")
    return [(size, statistics.median(values)) for size, values in sorted(sizes.items())]


def all_reduce_ms(table: list[tuple[float, float]], size_bytes: float) -> float:
    """The measured time of an all-reduce of `size_bytes`, linear between the sizes measured, plus
    Vidur's NCCL launch overhead."""
    sizes = [s for s, _ in table]
    if not sizes[0] <= size_bytes <= sizes[-1]:
        raise ValueError(f"all-reduce of {size_bytes:g} bytes is outside the measured {sizes[0]:g}-{sizes[-1]:g}")
    return float(np.interp(size_bytes, sizes, [t for _, t in table])) + NCCL_LAUNCH_MS


@dataclass(frozen=True, slots=True)
class Parallel:
    """Tensor parallelism's all-reduces: the measured table and the hidden size they carry."""

    all_reduce: list[tuple[float, float]]
    hidden: int


def iteration_ms(times: Times, layers: int, parallel: Parallel | None = None) -> dict[int, float]:
    """One iteration's linear time per token count: `layers × Σ operators` (+ the all-reduces)."""
    result = {}
    for n, ops in times.items():
        layer = sum(ops[op] for op in LAYER_OPERATORS)
        if parallel is not None:
            layer += ALL_REDUCES_PER_LAYER * all_reduce_ms(parallel.all_reduce, n * parallel.hidden * 2)
        result[n] = layers * layer
    return result


def fit_fixed_and_per_token(iteration: dict[int, float]) -> LineFit:
    """`ms = c + a·tokens` (both >= 0), relative least squares (a 6 ms step counts as a 90 ms one)."""
    tokens = np.array(list(iteration), dtype=float)
    ms = np.array(list(iteration.values()), dtype=float)
    x = np.column_stack([np.ones_like(tokens), tokens])
    weights = 1.0 / ms
    intercept, slope = (float(v) for v in nonnegative_least_squares(x * weights[:, None], ms * weights))
    return LineFit(intercept, slope, fit_quality(ms, x @ np.array([intercept, slope])))


def lm_head_read_ms(vocab: int, hidden: int, tensor_parallel: int, dtype_bytes: int = 2) -> float:
    """The LM head's weights read once per step from HBM, each GPU its 1/TP shard (ms)."""
    return vocab * hidden * dtype_bytes / tensor_parallel / H100_HBM_BYTES_PER_S * 1e3


def decode_read_us_per_token(layers: int, kv_heads: int, head_dim: int, tensor_parallel: int,
                             dtype_bytes: int = 2) -> float:
    """`b`: a context token's K and V of every layer read from HBM, each GPU its KV heads' share (µs)."""
    return 2 * layers * kv_heads * head_dim * dtype_bytes / tensor_parallel / H100_HBM_BYTES_PER_S * 1e6


def attention_ns_per_pair(layers: int, query_heads: int, head_dim: int, tensor_parallel: int) -> float:
    """`e`: one (query, key) pair costs `4·head_dim` FLOPs per query head (Q·Kᵀ and P·V, a multiply
    and an add each), every layer, each GPU its heads' share, at FlashAttention-3's causal rate (ns)."""
    return 4 * head_dim * query_heads * layers / tensor_parallel / FA3_CAUSAL_FLOPS_PER_S * 1e9


@dataclass(frozen=True, slots=True)
class Derived:
    """One profile's derived constants and the fit behind `c` and `a`."""

    name: str
    fit: LineFit  # ms over tokens, the Vidur operators alone
    lm_head_ms: float
    b_us: float
    e_ns: float

    @property
    def c_ms(self) -> float:
        return self.fit.intercept + self.lm_head_ms

    def as_dict(self) -> dict[str, float | str]:
        q = self.fit.quality
        return {"name": self.name, "iteration_ms_fixed": round(self.c_ms, 3), "vidur_intercept_ms": round(self.fit.intercept, 3),
                "lm_head_ms": round(self.lm_head_ms, 3), "iteration_ms_per_token": round(self.fit.slope, 5),
                "iteration_us_per_context_token": round(self.b_us, 4), "iteration_ns_per_attention_pair": round(self.e_ns, 3),
                "fit_relative_rms": round(q.relative_rms, 4), "fit_max_relative_error": round(q.max_relative_error, 4),
                "fit_samples": q.samples}


def derive(vidur: Path) -> list[Derived]:
    """Both H100 profiles from a checkout of microsoft/vidur (its `data/profiling` folder)."""
    compute, network = vidur / "data/profiling/compute", vidur / "data/profiling/network"
    llama2_7b_h100 = read_operator_times(compute / "h100/meta-llama/Llama-2-7b-hf/mlp.csv", 1)
    llama2_7b_a100 = read_operator_times(compute / "a100/meta-llama/Llama-2-7b-hf/mlp.csv", 1)
    llama3_8b_a100 = read_operator_times(compute / "a100/meta-llama/Meta-Llama-3-8B/mlp.csv", 1)
    small = iteration_ms(transfer(llama3_8b_a100, llama2_7b_h100, llama2_7b_a100), layers=32)
    llama2_70b_h100 = read_operator_times(compute / "h100/meta-llama/Llama-2-70b-hf/mlp.csv", 4)
    parallel = Parallel(read_all_reduce(network / "h100_dgx/all_reduce.csv", 4), hidden=8192)
    large = iteration_ms(llama2_70b_h100, layers=80, parallel=parallel)
    return [
        Derived("llama3-8b-h100", fit_fixed_and_per_token(small), lm_head_read_ms(128_256, 4096, 1),
                decode_read_us_per_token(32, 8, 128, 1), attention_ns_per_pair(32, 32, 128, 1)),
        Derived("llama3-70b-4xh100", fit_fixed_and_per_token(large), lm_head_read_ms(128_256, 8192, 4),
                decode_read_us_per_token(80, 8, 128, 4), attention_ns_per_pair(80, 64, 128, 4)),
    ]


def main(argv: list[str]) -> int:
    usage = "usage: python -m marsched.bench.vidur_profile VIDUR_CHECKOUT (a clone of microsoft/vidur)"
    if len(argv) != 1:
        print(usage, file=sys.stderr)
        return 2
    if not Path(argv[0]).is_dir():
        print(f"error: VIDUR_CHECKOUT {argv[0]}: not a directory\n{usage}", file=sys.stderr)
        return 2
    try:
        profiles = derive(Path(argv[0]))
    except OSError as error:  # a file the derivation reads is missing or unreadable: not a Vidur clone
        print(f"error: VIDUR_CHECKOUT {argv[0]}: {error.filename}: {error.strerror}", file=sys.stderr)
        return 2
    except ValueError as error:  # names the file and row
        print(f"error: {error}", file=sys.stderr)
        return 2
    for derived in profiles:
        print(json.dumps(derived.as_dict()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

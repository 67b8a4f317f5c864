"""What one `marsched bench` run is: the model, the trace, the points (policy × qps) and how they run."""

from __future__ import annotations

import math
from dataclasses import dataclass

from marsched.bench.engine_config import EnginePlan, plan_engine
from marsched.bench.model import ModelInfo
from marsched.bench.options import (
    check_api_estimator, check_dtype, check_engine_profile, check_kv_cache_gb, check_nonnegative, check_policy,
    check_positive, check_predictor, check_seed, check_starvation,
)
from marsched.policy.registry import POLICY_NAMES, SIMULATOR_ONLY, simulator_only_reason


@dataclass(frozen=True, slots=True)
class BenchSpec:
    model: str
    trace: str = "single"
    policies: tuple[str, ...] = ("vllm", "infercept", "mars")
    qps: tuple[float, ...] = (1.0,)
    duration_s: float = 60.0
    seed: int = 0
    api_time_scale: float = 1.0
    token_scale: float = 1.0
    kv_cache_gb: float | None = None  # None: VLLM_CPU_KVCACHE_SPACE as set, else 1 GiB
    max_requests: int | None = None
    max_model_len: int | None = None
    predictor: str = "oracle"
    api_estimator: str = "type-mean"
    strict: bool = False
    dtype: str = "auto"  # auto: the model's own (config.json)
    profile: str | None = None  # the plugin's cost model (a profile name or .json path); None: placeholders
    starvation: str = "default"  # MARS's starvation variant (`--starvation`); "default": the policy's own

    def check(self) -> None:
        """ValueError naming the option of the first bad value."""
        if not self.policies:
            raise ValueError(f"--policies {','.join(self.policies)!r}: name at least one of {', '.join(POLICY_NAMES)}")
        for policy in self.policies:
            check_policy("--policies", policy)
            if policy in SIMULATOR_ONLY:
                raise ValueError(f"--policies {policy}: {simulator_only_reason(policy)}")
        check_predictor(self.predictor)
        check_api_estimator(self.api_estimator)
        check_positive("--duration", self.duration_s)
        check_positive("--token-scale", self.token_scale)
        if not self.qps or not all(math.isfinite(q) and q > 0 for q in self.qps):
            raise ValueError(f"--qps {self.qps}: give finite arrival rates > 0")
        check_nonnegative("--api-time-scale", self.api_time_scale)
        check_kv_cache_gb(self.kv_cache_gb)
        if self.max_requests is not None and self.max_requests < 1:
            raise ValueError(f"--max-requests {self.max_requests}: give at least 1")
        if self.max_model_len is not None and self.max_model_len < 32:
            raise ValueError(f"--max-model-len {self.max_model_len}: give at least 32")
        check_dtype(self.dtype)
        check_starvation(self.starvation)
        check_seed(self.seed)
        if self.profile is not None:
            check_engine_profile(self.profile)

    def engine_plan(self, model: ModelInfo) -> EnginePlan:
        """How the engine of every point is sized for `model` (ValueError: a KV cache too small)."""
        return plan_engine(model, dtype=self.dtype, kv_cache_gb=self.kv_cache_gb, max_model_len=self.max_model_len)

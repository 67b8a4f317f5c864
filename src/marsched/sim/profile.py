"""Hardware/model profiles: data files in `profiles/`, each constant with its source."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path

from marsched.policy.cost_model import CostModel

_GB = 1e9


@dataclass(frozen=True, slots=True)
class Profile:
    name: str
    description: str
    kv_bytes_per_token: float  # on the whole engine (all tensor-parallel GPUs together)
    device_blocks: int
    host_blocks: int
    block_tokens: int
    cost: CostModel
    # Running requests at most (vLLM's max_num_seqs); None: only memory and the token budget bound
    # the batch. Profiles written before the field load with None.
    max_sequences: int | None = None
    # Whether a waiting request is admitted only when its whole prompt fits, not just its first chunk
    # (vLLM's `scheduler_reserve_full_isl`, on by default in 0.32 and 0.33). Profiles written before the field
    # load with False: the chunk is enough.
    admits_whole_prompt: bool = False

    @property
    def device_tokens(self) -> int:
        return self.device_blocks * self.block_tokens

    @property
    def host_tokens(self) -> int:
        return self.host_blocks * self.block_tokens


def profile_names() -> list[str]:
    folder = resources.files("marsched.sim") / "profiles"
    return sorted(p.name.removesuffix(".json") for p in folder.iterdir() if p.name.endswith(".json"))


def load_profile(name_or_path: str) -> Profile:
    """A bundled profile by name, or a profile JSON file by path."""
    path = Path(name_or_path)
    if path.suffix == ".json" and path.exists():
        text, origin = path.read_text(), str(path)
    else:
        names = profile_names()
        if name_or_path not in names:
            raise ValueError(f"unknown profile {name_or_path!r}; valid: {', '.join(names)} (or a path to a .json profile)")
        entry = resources.files("marsched.sim") / "profiles" / f"{name_or_path}.json"
        text, origin = entry.read_text(), f"profile {name_or_path}"
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{origin}: not valid JSON ({error})") from None
    return profile_from_dict(data, origin)


def _number(data: dict, key: str, origin: str, positive: bool = True) -> float:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{origin}: field {key!r} must be a number, got {value!r}")
    if positive and value <= 0:
        raise ValueError(f"{origin}: field {key!r} must be > 0, got {value!r}")
    return float(value)


def _optional_nonnegative(data: dict, key: str, origin: str) -> float:
    """A cost term that profiles may leave out (0: the term is not modelled), else a number >= 0."""
    if key not in data:
        return 0.0
    value = _number(data, key, origin, positive=False)
    if value < 0:
        raise ValueError(f"{origin}: field {key!r} must be >= 0, got {value!r}")
    return value


def _blocks(data: dict, key: str, origin: str, least: int) -> int:
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{origin}: field {key!r} must be a whole number of blocks >= {least}, got {value!r}")
    return value


def _capacity(data: dict, origin: str, block_bytes: float) -> tuple[int, int]:
    """(device blocks, host blocks): stated directly (a measured profile: `device_blocks`,
    `host_blocks`, what the engine reported) or derived from memory sizes (`gpus` ×
    `gpu_memory_gb` × `gpu_memory_utilization` less the weights; `host_swap_gb`). Not both."""
    derived_device = ("gpus", "gpu_memory_gb", "gpu_memory_utilization")
    if "device_blocks" in data:
        both = [key for key in derived_device if key in data]
        if both:
            raise ValueError(f"{origin}: give either 'device_blocks' (measured) or {', '.join(map(repr, derived_device))} "
                             f"(derived), not both; found {', '.join(map(repr, both))}")
        device_blocks = _blocks(data, "device_blocks", origin, 1)
    else:
        model = data["model"]
        parameters = _number(model, "parameters", f"{origin} model")
        usable_bytes = (_number(data, "gpus", origin) * _number(data, "gpu_memory_gb", origin) * _GB
                        * _number(data, "gpu_memory_utilization", origin))
        kv_bytes = usable_bytes - parameters * _number(model, "dtype_bytes", f"{origin} model")
        if kv_bytes <= 0:
            raise ValueError(f"{origin}: the model's weights do not leave room for a KV cache")
        device_blocks = int(kv_bytes // block_bytes)
    if "host_blocks" in data:
        if "host_swap_gb" in data:
            raise ValueError(f"{origin}: give either 'host_blocks' or 'host_swap_gb', not both")
        host_blocks = _blocks(data, "host_blocks", origin, 0)
    else:
        host_blocks = int(_number(data, "host_swap_gb", origin, positive=False) * _GB // block_bytes)
    return device_blocks, host_blocks


def profile_from_dict(data: dict, origin: str) -> Profile:
    if not isinstance(data, dict) or not isinstance(data.get("model"), dict):
        raise ValueError(f"{origin}: a profile is an object with a 'model' object")
    model = data["model"]
    model_origin = f"{origin} model"
    layers = _number(model, "layers", model_origin)
    kv_hidden = _number(model, "kv_hidden_size", model_origin)
    dtype_bytes = _number(model, "dtype_bytes", model_origin)
    kv_bytes_per_token = 2 * layers * kv_hidden * dtype_bytes  # K and V, every layer
    block_tokens = int(_number(data, "block_tokens", origin))
    device_blocks, host_blocks = _capacity(data, origin, kv_bytes_per_token * block_tokens)
    link_bytes_per_s = _number(data, "link_gb_per_s", origin) * _GB
    cost = CostModel(
        seconds_per_token=_number(data, "iteration_ms_per_token", origin) / 1000,
        seconds_per_iteration=_number(data, "iteration_ms_fixed", origin) / 1000,
        token_budget=int(_number(data, "token_budget", origin)),
        swap_tokens_per_s=link_bytes_per_s / kv_bytes_per_token,
        # Optional, so that profiles written for the linear model `c + a·tokens` keep loading.
        seconds_per_context_token=_optional_nonnegative(data, "iteration_us_per_context_token", origin) / 1e6,
        seconds_per_sequence=_optional_nonnegative(data, "iteration_ms_per_sequence", origin) / 1000,
        seconds_per_attention_pair=_optional_nonnegative(data, "iteration_ns_per_attention_pair", origin) / 1e9,
    )
    return Profile(
        name=str(data.get("name", origin)),
        description=str(data.get("description", "")),
        kv_bytes_per_token=kv_bytes_per_token,
        device_blocks=device_blocks,
        host_blocks=host_blocks,
        block_tokens=block_tokens,
        cost=cost,
        max_sequences=_max_sequences(data, origin),
        admits_whole_prompt=_flag(data, "admits_whole_prompt", origin),
    )


def _flag(data: dict, key: str, origin: str) -> bool:
    value = data.get(key, False)
    if not isinstance(value, bool):
        raise ValueError(f"{origin}: field {key!r} must be true or false, got {value!r}")
    return value


def _max_sequences(data: dict, origin: str) -> int | None:
    value = data.get("max_num_seqs")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{origin}: field 'max_num_seqs' must be a whole number of requests >= 1, got {value!r}")
    return value


def scale_kv_capacity(profile: Profile, factor: float) -> Profile:
    """The same engine with `factor` times the device KV blocks (at least one); host memory, cost and
    block size unchanged. A regime map's KV axis: what a smaller or larger GPU memory share would do,
    every other constant kept."""
    if not (math.isfinite(factor) and factor > 0):
        raise ValueError(f"KV capacity scale must be a finite number > 0, got {factor!r}")
    if factor == 1:
        return profile
    # The name stays: records say the scale beside it (`kv_scale`), so they group by profile.
    return replace(profile, device_blocks=max(1, round(profile.device_blocks * factor)))

"""The checks of the options that runs share (simulated and real), one function each.

Each raises ValueError with a message that starts with the flag and its value, so that the
`marsched` commands (`marsched.cli_checks.checked`) and the specs that library users build
(`BenchSpec.check`) report a bad value in the same words. A command composes the checks it
needs in its own order: with several bad values, the first one checked is the one reported.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from marsched.policy import Admission
from marsched.policy.registry import POLICY_NAMES, parse_threshold, starvation_config
from marsched.predict import parse_api_estimator, parse_length_predictor
from marsched.sim.profile import load_profile

T = TypeVar("T")
DEFAULT = "default"  # an option left to the policy's own choice
RUN_DTYPES = ("auto", "bfloat16", "float32")  # --dtype of bench and calibrate; auto: the model's own


def named(flag: str, value: Any, check: Callable[[], T]) -> T:
    """`check()`, with a ValueError's message prefixed by the flag and its value."""
    try:
        return check()
    except ValueError as error:
        raise ValueError(f"{flag} {value}: {error}") from None


def check_seed(seed: int) -> None:
    if not 0 <= seed < 2**32:
        raise ValueError(f"--seed {seed}: give an integer from 0 to 2^32-1")


def check_positive(flag: str, value: float) -> float:
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{flag} {value:g}: give a finite number > 0")
    return value


def check_nudge_m(value: int) -> int:
    """mars-nudge's window: how many of the last waiting requests a small arrival may swap with."""
    if value < 1:
        raise ValueError(f"--nudge-m {value}: give a window of 1 or more waiting requests")
    return value


def check_nonnegative(flag: str, value: float) -> float:
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{flag} {value:g}: give a finite number >= 0")
    return value


def check_kv_cache_gb(gib: float | None) -> None:
    if gib is not None and not (math.isfinite(gib) and gib > 0):
        raise ValueError(f"--kv-cache-gb {gib:g}: give a finite number of GiB > 0")


def check_dtype(dtype: str) -> None:
    if dtype not in RUN_DTYPES:
        raise ValueError(f"--dtype {dtype}: valid: {', '.join(RUN_DTYPES)}")


def check_policy(flag: str, name: str) -> str:
    if name not in POLICY_NAMES:
        raise ValueError(f"{flag} {name}: unknown policy; valid: {', '.join(POLICY_NAMES)}")
    return name


def check_refresh_interval(refresh_interval: int) -> None:
    if refresh_interval < 1:
        raise ValueError(f"--refresh-interval {refresh_interval}: give a number of iterations >= 1")


def check_starvation(starvation: str) -> None:
    """A starvation variant (`fcfs-wait:K` included) or `default`."""
    if starvation != DEFAULT:
        named("--starvation", starvation, lambda: starvation_config(starvation))


def check_admission(admission: str) -> None:
    valid = [a.value for a in Admission]
    if admission != DEFAULT and admission not in valid:
        raise ValueError(f"--admission {admission}: unknown rule; valid: {', '.join(valid)}, default")


def starvation_threshold(text: str) -> float | None | str:
    """`--starvation-threshold`: `default`, `off` (None) or a positive number."""
    return named("--starvation-threshold", text, lambda: DEFAULT if text == DEFAULT else parse_threshold(text))


def check_predictor(predictor: str, seed: int = 0) -> None:
    named("--predictor", predictor, lambda: parse_length_predictor(predictor, seed))


def check_api_estimator(api_estimator: str) -> None:
    named("--api-estimator", api_estimator, lambda: parse_api_estimator(api_estimator))


def check_profile(profile: str) -> None:
    """A profile for the simulator (a bundled name or a .json path)."""
    named("--profile", profile, lambda: load_profile(profile))


def engine_profile(profile: str) -> str:
    """A profile for the vLLM plugin: a file becomes an absolute path (vLLM's engine core, in its own
    process and directory, reads it); a name stays as it is."""
    return str(Path(profile).absolute()) if Path(profile).is_file() else profile


def check_engine_profile(profile: str) -> None:
    """A profile the vLLM plugin can load its cost model from."""
    from marsched.vllm.config import profile_cost  # marsched.vllm: loaded only when a profile is given

    named("--profile", profile, lambda: profile_cost(profile))


def check_run_options(*, profile: str | None = None, seed: int = 0, predictor: str = "oracle",
                      api_estimator: str = "type-mean", starvation_threshold_text: str = DEFAULT,
                      starvation: str = DEFAULT, admission: str = DEFAULT, refresh_interval: int = 1,
                      duration: float | None = None) -> float | None | str:
    """The options of `simulate`, `compare` and `serve`, each on its own, in this order; returns the
    starvation threshold parsed."""
    check_seed(seed)
    if duration is not None:
        check_positive("--duration", duration)
    check_refresh_interval(refresh_interval)
    check_starvation(starvation)
    check_admission(admission)
    threshold = starvation_threshold(starvation_threshold_text)
    check_predictor(predictor, seed)
    check_api_estimator(api_estimator)
    if profile is not None:
        check_profile(profile)
    return threshold

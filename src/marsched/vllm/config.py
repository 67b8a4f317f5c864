"""How the policy and its parameters reach the scheduler in vLLM's engine-core process.

The scheduler is built by vLLM inside the EngineCore process, from a `VllmConfig`
that vLLM serializes there. Our settings travel in that config, under
`VllmConfig.additional_config["marsched"]` (CLI: `--additional-config`), as a plain
JSON object. The environment variable `MARSCHED_CONFIG` (a JSON object) is read as
a fallback when `additional_config` has no `marsched` entry.

This module does not import vllm.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from marsched.policy import CostModel, Policy, make_policy, parse_threshold
from marsched.policy.learned_cost import CostSource
from marsched.policy.boost import DEFAULT_BOOST_GAMMA
from marsched.policy.nudge import DEFAULT_NUDGE_M
from marsched.policy.program_rest import DEFAULT_REST, RestRule
from marsched.policy.registry import SIMULATOR_ONLY, parse_rest, simulator_only_reason
from marsched.policy.retention import DEFAULT_LIMIT_S, RetentionRule, parse_retention
from marsched.predict import SegmentPredictor, parse_api_estimator, parse_length_predictor

CONFIG_KEY = "marsched"
ENV_VAR = "MARSCHED_CONFIG"


@dataclass(frozen=True, slots=True)
class CostSettings:
    """The cost model the policy decides with (`marsched.policy.CostModel`).

    Defaults are placeholders of the right order for a small model on one CPU socket: the
    scheduler replaces them with what it learns from the engine's own steps and copies
    (`MarsConfig.learn_cost`). Constants set here are used as given. `token_budget=0` takes vLLM's
    `max_num_batched_tokens`.
    """

    seconds_per_token: float = 2e-5
    seconds_per_iteration: float = 0.01
    token_budget: int = 0
    swap_tokens_per_s: float = 1e6


def profile_cost(name_or_path: str) -> CostModel:
    """The cost model of a profile (bundled name or .json path); ValueError naming the file."""
    from marsched.sim.profile import load_profile  # profiles are data; the simulator is not run

    path = Path(name_or_path)
    if (path.suffix == ".json" or os.sep in name_or_path) and not path.is_file():
        raise ValueError(f"no profile file {name_or_path} (working directory {os.getcwd()})")
    try:
        return load_profile(name_or_path).cost
    except OSError as error:
        raise ValueError(f"{name_or_path}: cannot read it ({error})") from None


@dataclass(frozen=True, slots=True)
class MarsConfig:
    policy: str = "mars"  # mars, infercept, vllm, sjf, preserve, discard, swap
    starvation: str = "default"  # a starvation variant (fcfs-wait[:K], age, published, iterations, off) or the policy's default
    starvation_threshold: float | str | None = "default"  # in the variant's units, "off", or its default
    starvation_quantum: int | str = "default"  # iterations of protection for the quantum variants
    admission: str = "default"  # greedy | predicted-peak, or the policy's default
    refresh_interval: int = 1
    predictor: str = "oracle"  # output-length predictor: oracle | noisy:SIGMA | learned[:DIR] (made in the front end)
    api_estimator: str = "type-mean"  # oracle | type-mean (updated with observed call times)
    seed: int = 0
    trace_path: str | None = None  # JSONL event trace written by the scheduler
    host_swap_tokens: int = 1 << 22  # host memory for swapped KV, in tokens
    allow_request_strategy: bool = True  # honour a per-request strategy override (tests, benches)
    # A conversation's KV between its turns (`marsched.policy.retention`): policy | off | fixed:SECONDS,
    # and the time after which a follow-up that has not come finds nothing kept.
    retention: str = "policy"
    retention_limit_s: float = DEFAULT_LIMIT_S
    # A request naming no conversation is a turn of the one whose finished turn its prompt continues
    # (`marsched.vllm.follow_ups`; needs vLLM's prefix caching, which computes the block hashes).
    infer_conversations: bool = True
    # How a conversation's turns to come weigh in its key (`policy/program_rest.py`): gittins or mean,
    # learnt from the programs that ended (over HTTP a program's rest is never known: no plan).
    rest: str = DEFAULT_REST
    boost_gamma: float = DEFAULT_BOOST_GAMMA  # γ of mars-boost's order, per device second (`policy/boost.py`)
    nudge_m: int = DEFAULT_NUDGE_M  # mars-nudge's window: the last M waiting requests (`policy/nudge.py`)
    cost: CostSettings = field(default_factory=CostSettings)
    # A profile (bundled name or .json path, e.g. from `marsched calibrate`): its cost model
    # replaces `cost`, with vLLM's token budget. A relative path is read from the engine's
    # working directory: give an absolute one to a server started elsewhere.
    profile: str | None = None
    # Learn the cost model from the engine's own step times and copies (`policy/learned_cost.py`)
    # where it would otherwise be a placeholder: never where a profile or constants were given.
    learn_cost: bool = True

    def __post_init__(self) -> None:
        # Validate early, in the caller's process, with a clear message.
        if self.profile is not None:
            if not isinstance(self.profile, str) or not self.profile:
                raise ValueError(f"marsched config 'profile': give a profile name or a .json path, got {self.profile!r}")
            if self.cost != CostSettings():
                raise ValueError("marsched config: give either 'profile' (a measured cost model) or 'cost', not both")
        if not isinstance(self.learn_cost, bool):
            raise ValueError(f"marsched config 'learn_cost': give true or false, got {self.learn_cost!r}")
        if self.policy in SIMULATOR_ONLY:
            raise ValueError(f"marsched config 'policy': {self.policy} {simulator_only_reason(self.policy)}")
        if (isinstance(self.boost_gamma, bool) or not isinstance(self.boost_gamma, (int, float))
                or not (self.boost_gamma > 0 and math.isfinite(self.boost_gamma))):
            raise ValueError(f"marsched config 'boost_gamma': give a number > 0, got {self.boost_gamma!r}")
        if isinstance(self.nudge_m, bool) or not isinstance(self.nudge_m, int) or self.nudge_m < 1:
            raise ValueError(f"marsched config 'nudge_m': give a whole number >= 1, got {self.nudge_m!r}")
        self.build_policy(token_budget=1)
        self.retention_rule()
        self.rest_rule()

    def rest_rule(self) -> RestRule:
        """The rule for a program's turns to come; ValueError naming the key."""
        try:
            rule = parse_rest(self.rest)
        except ValueError as error:
            raise ValueError(f"marsched config 'rest': {error}") from None
        if rule is RestRule.PLAN:
            raise ValueError("marsched config 'rest': over HTTP a program's turns to come are never known; "
                             "give gittins or mean")
        return rule

    # --- (de)serialization --------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "MarsConfig":
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"marsched config: unknown keys {sorted(unknown)}; valid: {sorted(known)}")
        data = dict(data)
        if isinstance(data.get("cost"), dict):
            data["cost"] = CostSettings(**data["cost"])
        return cls(**data)

    @classmethod
    def from_vllm_config(cls, vllm_config: Any) -> "MarsConfig":
        extra = getattr(vllm_config, "additional_config", None) or {}
        if isinstance(extra, dict) and CONFIG_KEY in extra:
            return cls.from_dict(extra[CONFIG_KEY])
        env = os.environ.get(ENV_VAR)
        if env:
            return cls.from_dict(json.loads(env))
        return cls()

    @property
    def learned(self) -> bool:
        """Whether lengths are predicted by the learned model (in the front end, from the prompt's text)."""
        return self.predictor == "learned" or self.predictor.startswith("learned:")

    @property
    def front_end(self) -> bool:
        """Whether length predictions come with the requests (`predicted` in their metadata): the
        learned model's, made in the front end, or a trace replay's type means (`marsched bench`)."""
        return self.learned or self.predictor == "type-mean"

    def additional_config(self) -> dict[str, Any]:
        """The value to pass as vLLM's `additional_config`."""
        return {CONFIG_KEY: self.to_dict()}

    # --- the policy ---------------------------------------------------------------

    def retention_rule(self) -> RetentionRule:
        if isinstance(self.retention_limit_s, bool) or not isinstance(self.retention_limit_s, (int, float)):
            raise ValueError(f"marsched config 'retention_limit_s': give seconds > 0, got {self.retention_limit_s!r}")
        try:
            return parse_retention(self.retention, float(self.retention_limit_s))
        except ValueError as error:
            raise ValueError(f"marsched config 'retention': {error}") from None

    def cost_model(self, token_budget: int) -> CostModel:
        if self.profile is not None:
            try:
                return replace(profile_cost(self.profile), token_budget=token_budget)
            except ValueError as error:
                raise ValueError(f"marsched config 'profile': {error}") from None
        c = self.cost
        return CostModel(c.seconds_per_token, c.seconds_per_iteration, c.token_budget or token_budget, c.swap_tokens_per_s)

    def cost_sources(self) -> tuple[CostSource, CostSource]:
        """Where the iteration terms and the swap rate come from: a profile, constants given, or the
        placeholders (which the scheduler learns over, when `learn_cost`)."""
        if self.profile is not None:
            return CostSource.PROFILE, CostSource.PROFILE
        given, default = self.cost, CostSettings()
        step_given = (given.seconds_per_token, given.seconds_per_iteration) != (default.seconds_per_token,
                                                                               default.seconds_per_iteration)
        return (CostSource.CONFIGURED if step_given else CostSource.PLACEHOLDER,
                CostSource.CONFIGURED if given.swap_tokens_per_s != default.swap_tokens_per_s else CostSource.PLACEHOLDER)

    def build_policy(self, token_budget: int) -> Policy:
        length = parse_length_predictor(self.predictor, self.seed)
        if self.front_end:  # predicted in the front end (from the text, or the trace); the scheduler reads the plan
            from marsched.predict.learned import FrontEndLength

            length = FrontEndLength(length.name)
        predictor = SegmentPredictor(length, parse_api_estimator(self.api_estimator))
        kwargs: dict[str, Any] = {}
        if self.starvation_threshold != "default":
            t = self.starvation_threshold
            kwargs["starvation_threshold"] = parse_threshold(str(t)) if t is not None else None
        for key in ("starvation", "starvation_quantum", "admission"):
            if getattr(self, key) != "default":
                kwargs[key] = getattr(self, key)
        policy = make_policy(
            self.policy,
            self.cost_model(token_budget),
            predictor=predictor,
            refresh_interval=self.refresh_interval,
            boost_gamma=float(self.boost_gamma),
            nudge_m=self.nudge_m,
            **kwargs,
        )
        # The key reads each request's plan, which its client declared (`max_tokens` for a plain
        # one); the program's turns to come are the scheduler's `ProgramLedger`'s.
        return replace(policy, plan_is_declared=True)

"""Which simulator runs a policy."""

from __future__ import annotations

from marsched.policy.policy import Policy, StrategyRule
from marsched.sim.engine import Simulator
from marsched.sim.infercept_code import InferceptCodeSimulator
from marsched.sim.profile import Profile
from marsched.workload.model import Request


def make_simulator(requests: list[Request], profile: Profile, policy: Policy, **kwargs) -> Simulator:
    """The engine for `policy`: INFERCEPT's published code (`infercept-code`) schedules in ways of
    its own (budgeted partial swaps, three passes) and has its own subclass."""
    engine = InferceptCodeSimulator if policy.rule is StrategyRule.BUDGETED else Simulator
    return engine(requests, profile, policy, **kwargs)

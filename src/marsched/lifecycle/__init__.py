"""The call lifecycle both engines share: one driver, each engine supplying its blocks and its clock.

`CallLifecycle` (driver.py) owns every step around the policy's decisions that the simulator
and the vLLM plugin have in common: a segment's start and strategy, the call, the pause, the
return, the resume, admission and its protection, preemption, the starvation promotions,
and the trace event of each. The iteration-time estimate τ (tau.py) and the preemption
victim (victim.py) have their one definition here. An engine implements `EngineSide`
(its clock, its load, its block moves) and keeps its own per-request state, which the
driver reads through `CallHandle`.
"""

from marsched.lifecycle.driver import CallHandle, CallLifecycle, EngineSide
from marsched.lifecycle.tau import IterationTime
from marsched.lifecycle.victim import choose_victim

__all__ = ["CallHandle", "CallLifecycle", "EngineSide", "IterationTime", "choose_victim"]

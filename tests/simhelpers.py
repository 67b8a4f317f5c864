"""Small engines and workloads for simulator tests."""

from marsched.policy import CostModel
from marsched.sim.profile import Profile
from marsched.workload import ApiCall, ApiType, build_request

COST = CostModel(seconds_per_token=5e-5, seconds_per_iteration=0.01, token_budget=128, swap_tokens_per_s=20_000)


def small_profile(device_blocks: int = 64, host_blocks: int = 64, block_tokens: int = 16) -> Profile:
    return Profile("small", "test engine", 1.0, device_blocks, host_blocks, block_tokens, COST)


def two_segment(rid: str, arrival: float, prompt: int, first: int, api_s: float, returned: int, second: int,
                api_type: ApiType = ApiType.OTHER):
    return build_request(rid, prompt, [(first, ApiCall(api_type, api_s, returned)), (second, None)], arrival)


def single(rid: str, arrival: float, prompt: int, output: int):
    return build_request(rid, prompt, [(output, None)], arrival)

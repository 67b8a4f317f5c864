"""Property: over random workloads and every policy, KV blocks never leak or overflow."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from marsched.policy import POLICY_NAMES, make_policy
from marsched.sim.select import make_simulator
from marsched.workload import ApiCall, ApiType, build_request
from simhelpers import COST, small_profile

calls = st.builds(
    ApiCall,
    st.sampled_from(list(ApiType)),
    st.floats(min_value=0.0, max_value=3.0),
    st.integers(min_value=0, max_value=40),
)


@st.composite
def requests(draw):
    count = draw(st.integers(min_value=1, max_value=25))
    result = []
    for index in range(count):
        segments = draw(st.integers(min_value=1, max_value=4))
        parts = [(draw(st.integers(1, 60)), draw(calls)) for _ in range(segments - 1)]
        parts.append((draw(st.integers(1, 60)), None))
        arrival = draw(st.floats(min_value=0.0, max_value=5.0))
        result.append(build_request(f"r{index}", draw(st.integers(1, 150)), parts, arrival))
    return result


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    workload=requests(),
    policy_name=st.sampled_from(POLICY_NAMES),
    device_blocks=st.integers(min_value=40, max_value=120),
    host_blocks=st.integers(min_value=0, max_value=60),
    threshold=st.sampled_from([None, 3, 100]),
)
def test_blocks_in_use_equal_blocks_held_and_return_to_zero(workload, policy_name, device_blocks, host_blocks, threshold):
    profile = small_profile(device_blocks=device_blocks, host_blocks=host_blocks)
    if policy_name in ("infercept-code", "mars-boost", "mars-boost-label", "mars-nudge"):  # no starvation prevention: INFERCEPT's code has
        threshold = None  # none, and Boost and Nudge bound the overtaking themselves
    policy = make_policy(policy_name, COST, starvation_threshold=threshold)
    steps = []

    def check(simulator):
        simulator.check_invariants()
        steps.append(simulator.device.used)

    simulator = make_simulator(workload, profile, policy, on_step=check)
    result = simulator.run()
    assert len(result.records) == len(workload)
    assert simulator.device.used == 0 and simulator.host.used == 0
    assert not simulator.live and not simulator.running and len(simulator.queue) == 0
    assert steps and max(steps) <= device_blocks
    for record in result.records:
        assert record.finish_s >= record.first_token_s >= record.arrival_s
        assert record.e2e_s >= record.isolated_e2e_s - 1e-9  # no scheduler beats running alone

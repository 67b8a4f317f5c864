"""The simulated cluster (`sim/cluster.py`): replicas that run in pieces between arrivals give what
one whole run gives, every request ends on exactly one replica with its subagents, blocks are
conserved on each, and each routing rule places by what it is meant to read."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from marsched.policy import make_policy
from marsched.policy.placement import RankLoad
from marsched.sim.cluster import MemoryTime, Routing, Router, conversation_of, parse_routing, replica_load, simulate_cluster
from marsched.sim.select import make_simulator
from marsched.workload import ApiCall, ApiType, Spawn, build_request
from marsched.workload.arrivals import poisson_arrivals
from marsched.workload.loader import load_trace
from simhelpers import COST, single, small_profile


def replica_of(policy: str, device_blocks: int = 64):
    return lambda: make_simulator([], small_profile(device_blocks=device_blocks), make_policy(policy, COST))


def workload(qps: float = 40.0, seconds: float = 3.0):
    templates = [build_request(f"conv{i % 5}:t{i}", 40 + 7 * i, [(3 + i % 4, ApiCall(ApiType.TOOL, 0.05 * (i % 3), 4)),
                                                              (2 + i % 3, None)]) for i in range(12)]
    return poisson_arrivals(templates, qps, seconds, seed=1)


def by_id(records):
    return {r.request_id: dataclasses.astuple(r) for r in records}


@pytest.mark.parametrize("policy", ["mars", "vllm", "infercept", "infercept-code"])
def test_one_replica_run_in_pieces_is_the_whole_run(policy):
    requests = workload()
    whole = make_simulator(requests, small_profile(device_blocks=64), make_policy(policy, COST)).run()
    cluster = simulate_cluster(requests, replica_of(policy), 1, Routing.MARS)
    assert len(whole.records) == len(requests) > 50
    assert by_id(cluster.records) == by_id(whole.records)
    assert cluster.replicas[0].iterations == whole.iterations


@pytest.mark.parametrize("routing", list(Routing))
def test_every_request_ends_on_one_replica_with_blocks_conserved(routing):
    requests = workload(qps=120.0)
    engines = []

    def replica():
        engines.append(replica_of("mars", device_blocks=24)())
        return engines[-1]

    result = simulate_cluster(requests, replica, 4, routing)
    ids = [r.request_id for r in result.records]
    assert sorted(ids) == sorted(r.request_id for r in requests)
    assert sum(result.routed) == len(requests)
    assert all(result.routed) or routing is Routing.SESSION_AFFINE  # 5 conversations hashed on 4 replicas
    for engine in engines:
        assert engine.device.used == 0 and engine.host.used == 0
        engine.check_invariants()


def test_subagents_run_on_their_parents_replica():
    parent = build_request("P:t0", 100, [(4, ApiCall(ApiType.TOOL, 2.0, 5)), (2, None)], 0.0)
    child = dataclasses.replace(single("P:sa1", 0.5, 50, 3), spawned_by=Spawn("P:t0", 0))
    others = [single(f"o{i}:t0", 0.01 * i, 30, 2) for i in range(1, 8)]
    result = simulate_cluster([parent, child, *others], replica_of("mars"), 3, Routing.ROUND_ROBIN)
    where = {r.request_id: rank for rank, replica in enumerate(result.replicas) for r in replica.records}
    assert where["P:sa1"] == where["P:t0"]
    assert sum(result.routed) == 8  # the subagent is not routed: it goes with its parent


class FakeReplica:
    """What the router reads of a replica: requests whose MARS key is `key` (memory x time)."""

    def __init__(self, live=(), waiting=0, running=0, used=0):
        self.live = {}
        for key in live:
            self.add(key)
        self.queue = [None] * waiting
        self.running = [None] * running
        self.device = SimpleNamespace(used=used, capacity=100)
        self.policy = SimpleNamespace(
            memory_time_form=lambda progress, load: SimpleNamespace(at=lambda tau: progress.key))

    def add(self, key: float) -> None:
        self.live[f"r{len(self.live)}"] = SimpleNamespace(progress=SimpleNamespace(predictions=[1], segment_index=0,
                                                                                  key=key))

    def load(self):
        return SimpleNamespace(iteration_s=0.01)


def test_the_rules_read_what_they_are_meant_to():
    # replica 0: one request of a long memory x time; replica 1: four short ones, all running
    replicas = [FakeReplica(live=[9000.0], running=1), FakeReplica(live=[10.0] * 4, running=4)]
    request = single("new:t0", 0.0, 10, 1)
    assert Router(Routing.MARS, replicas).route(request) == 1
    assert Router(Routing.LEAST_LOADED, replicas).route(request) == 0  # vLLM's rule counts requests
    robin = Router(Routing.ROUND_ROBIN, replicas)
    assert [robin.route(request) for _ in range(4)] == [0, 1, 0, 1]
    affine = Router(Routing.SESSION_AFFINE, replicas)
    assert len({affine.route(single(f"c:t{i}", 0.0, 10, 1)) for i in range(6)}) == 1


def test_mars_affine_keeps_a_conversation_unless_its_replica_is_overloaded():
    replicas = [FakeReplica(live=[100.0]), FakeReplica(live=[120.0])]
    router = Router(Routing.MARS_AFFINE, replicas)
    assert router.route(single("c:t0", 0.0, 10, 1)) == 0
    replicas[0].add(60.0)
    assert router.route(single("c:t1", 0.0, 10, 1)) == 0  # 160 > 120, but under 1.5 x the mean (140)
    replicas[0].add(500.0)
    assert router.route(single("c:t2", 0.0, 10, 1)) == 1  # 660 > 1.5 x 390: to the lighter one
    assert Router(Routing.MARS, replicas).route(single("other:t0", 0.0, 10, 1)) == 1


def test_a_requests_key_is_priced_once_a_segment():
    replica = FakeReplica(live=[100.0])
    priced = []
    form = replica.policy.memory_time_form
    replica.policy.memory_time_form = lambda progress, load: priced.append(1) or form(progress, load)
    memory_time = MemoryTime()
    assert memory_time.of(replica) == memory_time.of(replica) == 100.0 and len(priced) == 1
    replica.live["r0"].progress.segment_index = 1
    replica.live["r0"].progress.key = 40.0
    assert memory_time.of(replica) == 40.0 and len(priced) == 2


def test_names_and_conversations():
    assert parse_routing("mars-affine") is Routing.MARS_AFFINE
    with pytest.raises(ValueError, match="--routing 'nearest': give one of round-robin, least-loaded"):
        parse_routing("nearest")
    assert conversation_of(single("trace_0002:t3", 0.0, 1, 1)) == "trace_0002"
    assert conversation_of(single("r17", 0.0, 1, 1)) == "r17"
    assert conversation_of(single("trace_0002:sa1:t0", 0.0, 1, 1)) == "trace_0002"  # a subagent's task
    instances = poisson_arrivals(load_trace("claude-code")[:40], 1.0, 20.0, seed=0)
    assert all(":" in r.template_id for r in instances)  # a task's conversation survives the arrivals


def test_memory_time_sums_the_predicted_requests_priced_at_the_replicas_load():
    replica = FakeReplica(live=[100.0, 20.0])
    replica.live["unpredicted"] = SimpleNamespace(progress=SimpleNamespace(predictions=[], segment_index=0))
    replica.live["r2"] = replica.live.pop("r1")  # one after the unpredicted one
    seen = []
    form = replica.policy.memory_time_form
    replica.policy.memory_time_form = lambda progress, load: seen.append(load) or form(progress, load)
    assert MemoryTime().of(replica) == 120.0
    assert len(seen) == 2 and all(load is not None and load.iteration_s == 0.01 for load in seen)


def test_memory_time_forgets_the_forms_of_ended_requests_past_twice_the_live_and_64():
    replica = FakeReplica()
    for i in range(66):
        replica.add(1.0)
    memory_time = MemoryTime()
    memory_time.of(replica)
    for i in range(1, 66):
        del replica.live[f"r{i}"]
    memory_time.of(replica)
    assert len(memory_time._forms) == 66  # 65 ended, 1 live: not more than 2 + 64
    replica.live["late"] = replica.live["r0"]
    memory_time.of(replica)
    del replica.live["late"]
    memory_time.of(replica)  # 66 ended, 1 live: more than 2 + 64
    assert set(memory_time._forms) == {"r0"}


def test_a_replicas_load_is_what_it_holds():
    replica = FakeReplica(live=[5.0, 7.0], waiting=3, running=1, used=25)
    assert replica_load(replica) == RankLoad(memory_time=0.0, tracked=2, waiting=3, running=1, kv_usage=0.25)
    assert replica_load(replica, MemoryTime()).memory_time == 12.0
    replica.device = SimpleNamespace(used=1, capacity=1)
    assert replica_load(replica).kv_usage == 1.0


def test_mars_alone_keeps_no_affinity_and_affinity_holds_at_exactly_the_balance_threshold():
    replicas = [FakeReplica(live=[100.0]), FakeReplica(live=[120.0])]
    mars = Router(Routing.MARS, replicas)
    assert mars.route(single("c:t0", 0.0, 10, 1)) == 0
    replicas[0].add(60.0)  # 160 against 120: the lighter is replica 1
    assert mars.route(single("c:t1", 0.0, 10, 1)) == 1
    replicas = [FakeReplica(live=[50.0]), FakeReplica(live=[100.0])]
    affine = Router(Routing.MARS_AFFINE, replicas)
    assert affine.route(single("c:t0", 0.0, 10, 1)) == 0
    replicas[0].add(250.0)  # 300 = 1.5 x the mean of 300 and 100: still its replica
    assert affine.route(single("c:t1", 0.0, 10, 1)) == 0


def test_round_robin_goes_round_in_order():
    robin = Router(Routing.ROUND_ROBIN, [FakeReplica() for _ in range(3)])
    assert [robin.route(single("x:t0", 0.0, 10, 1)) for _ in range(6)] == [0, 1, 2, 0, 1, 2]


def test_the_cluster_reports_progress_time_and_refuses_no_replicas():
    requests = workload()
    calls = []
    result = simulate_cluster(requests, replica_of("mars"), 2, Routing.SESSION_AFFINE,
                              on_progress=lambda done, total: calls.append((done, total)))
    n = len(requests)
    assert calls[0] == (0, n) and calls[-1] == (n, n) and len(calls) == n + 1
    assert 0 <= result.wallclock_s < 600
    where: dict[str, set[int]] = {}
    for rank, replica in enumerate(result.replicas):
        for record in replica.records:
            where.setdefault(record.request_id.split(":")[0], set()).add(rank)
    assert all(len(ranks) == 1 for ranks in where.values())  # session-affine: each conversation on one
    with pytest.raises(ValueError, match="--replicas 0: give 1 or more"):
        simulate_cluster(requests, replica_of("mars"), 0, Routing.MARS)


def test_a_subagents_own_subagents_go_with_it():
    parent = build_request("P:t0", 100, [(4, ApiCall(ApiType.TOOL, 2.0, 5)), (2, None)], 0.0)
    child = build_request("P:sa1:t0", 50, [(3, ApiCall(ApiType.TOOL, 1.0, 4)), (2, None)], 0.5)
    child = dataclasses.replace(child, spawned_by=Spawn("P:t0", 0))
    grandchild = dataclasses.replace(single("P:sa1:sa2:t0", 0.2, 20, 2), spawned_by=Spawn("P:sa1:t0", 0))
    others = [single(f"o{i}:t0", 0.01 * i, 30, 2) for i in range(1, 5)]
    result = simulate_cluster([parent, child, grandchild, *others], replica_of("mars"), 3, Routing.ROUND_ROBIN)
    where = {r.request_id: rank for rank, replica in enumerate(result.replicas) for r in replica.records}
    assert where["P:sa1:sa2:t0"] == where["P:sa1:t0"] == where["P:t0"]
    assert sum(result.routed) == 5

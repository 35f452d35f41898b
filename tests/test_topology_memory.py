"""The planner's topology (link levels, groups that cross hosts) and memory model."""

from __future__ import annotations

import pytest
import torch

from thinwire.plan.memory import (
    data_parallel_memory,
    exchange_state_bytes,
    held_bytes,
    optimizer_state_ratio,
)
from thinwire.plan.network import ALLGATHER, ALLREDUCE, Link, collective_time
from thinwire.plan.topology import Topology

NET = Link(100e6, 1e-3)
HOST = Link(10e9, 5e-6)


def test_a_group_runs_at_the_slowest_link_it_crosses() -> None:
    topology = Topology(hosts=2, ranks_per_host=4, inter=NET, intra=HOST)
    assert topology.world_size == 8 and topology.host_of(5) == 1
    inside, across = [0, 1, 2, 3], [0, 4]
    assert topology.time(ALLREDUCE, 8e6, inside) == collective_time(ALLREDUCE, 8e6, 4, HOST)
    assert topology.time(ALLREDUCE, 8e6, across) == collective_time(ALLREDUCE, 8e6, 2, NET)
    assert topology.time(ALLREDUCE, 8e6, across) > 50 * topology.time(ALLREDUCE, 8e6, inside)
    assert topology.network_bytes(ALLREDUCE, 8e6, inside) == 0
    assert topology.network_bytes(ALLGATHER, 1e6, [0, 4, 1, 5]) == 3e6


def test_groups_crossing_the_network_at_once_share_it() -> None:
    net = Link(100e6, 1e-3, store_and_forward=False)  # a step's latency without the rate
    topology = Topology(hosts=2, ranks_per_host=4, inter=net, intra=HOST)
    alone = topology.time(ALLREDUCE, 40e6, [0, 4])
    four = topology.time(ALLREDUCE, 40e6, [0, 4], sharing=4)
    bandwidth_part = alone - 2 * net.step_latency_s
    assert four == pytest.approx(2 * net.step_latency_s + 4 * bandwidth_part)


def test_the_flat_topology_is_the_data_parallel_model() -> None:
    flat = Topology.flat(4, NET)
    assert flat.time(ALLREDUCE, 1e6, range(4)) == collective_time(ALLREDUCE, 1e6, 4, NET)


def test_the_data_parallel_step_runs_on_the_link_its_group_spans() -> None:
    from thinwire.plan.cost import BucketCost, ComputeTime, MethodCost, group_step_time, step_time
    from thinwire.plan.network import Collective

    compute = ComputeTime(forward_s=0.1, backward_s=0.2, optimizer_s=0.0)
    cost = MethodCost("dense", (BucketCost(1.0, 0.0, (Collective(ALLREDUCE, 40e6),)),))
    slow, fast = Link(100e6, 1e-3), Link(10e9, 5e-6)
    topology = Topology(hosts=2, ranks_per_host=4, inter=slow, intra=fast)
    inside = group_step_time(compute, cost, topology, ranks=[0, 1, 2, 3])
    across = group_step_time(compute, cost, topology, ranks=[0, 4])
    shared = group_step_time(compute, cost, topology, ranks=[0, 4], sharing=4)
    assert inside == pytest.approx(step_time(compute, cost, fast, 4))
    assert across == pytest.approx(step_time(compute, cost, slow, 2))
    assert inside < across < shared
    flat = Topology.flat(4, slow)
    assert group_step_time(compute, cost, flat) == pytest.approx(step_time(compute, cost, slow, 4))


def test_bad_topologies_and_groups_are_refused() -> None:
    with pytest.raises(ValueError, match="ranks_per_host must be an integer >= 1"):
        Topology(hosts=2, ranks_per_host=0, inter=NET, intra=HOST)
    topology = Topology(hosts=2, ranks_per_host=2, inter=NET, intra=HOST)
    with pytest.raises(ValueError, match="rank 4 is not in this topology of 4 ranks"):
        topology.time(ALLREDUCE, 1e3, [0, 4])
    with pytest.raises(ValueError, match="distinct ranks"):
        topology.time(ALLREDUCE, 1e3, [1, 1])


def test_held_bytes_counts_each_storage_once_and_honours_exclusions() -> None:
    a = torch.zeros(100)
    state = {"x": a, "view": a[:10], "pair": (torch.zeros(50, dtype=torch.float64), a)}
    assert held_bytes(state) == 400 + 400
    assert held_bytes(state, exclude=[a]) == 400


def test_optimizer_state_is_measured() -> None:
    assert optimizer_state_ratio(torch.optim.SGD, lr=0.1) == 0
    assert optimizer_state_ratio(torch.optim.SGD, lr=0.1, momentum=0.9) == 1
    assert optimizer_state_ratio(torch.optim.Adam) == pytest.approx(2, abs=0.01)


PARAMS = [("a.weight", torch.zeros(256, 128)), ("a.bias", torch.zeros(256))]
WEIGHT_BYTES = sum(p.numel() * 4 for _, p in PARAMS)


def test_the_exchange_state_is_what_the_real_engine_holds() -> None:
    assert exchange_state_bytes("dense", PARAMS, world_size=4) == 0
    assert exchange_state_bytes("fp16", PARAMS, world_size=4) == 0
    # residuals, kept twice so that a refused step can be undone, at least
    assert exchange_state_bytes("randomk", PARAMS, world_size=4) >= 2 * WEIGHT_BYTES
    # DGC: velocities and accumulators, each kept twice
    assert exchange_state_bytes("dgc", PARAMS, world_size=4) >= 4 * WEIGHT_BYTES
    # PyTorch's hook: its error feedback once, and Q
    hook = exchange_state_bytes("ddp-powersgd", PARAMS, world_size=4)
    assert WEIGHT_BYTES <= hook < 1.1 * WEIGHT_BYTES
    estimate = data_parallel_memory(
        PARAMS, world_size=4, method="dgc", optimizer=torch.optim.Adam, optimizer_options={}
    )
    assert estimate.parameters == WEIGHT_BYTES and estimate.optimizer >= 2 * WEIGHT_BYTES
    assert estimate.total_bytes == sum(v for k, v in estimate.as_dict().items() if k != "total")

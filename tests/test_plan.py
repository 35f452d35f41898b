"""The cost model (alpha-beta formulas, timeline, break-even), profiling and ``thinwire plan``."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch
from torch import nn

import thinwire
from thinwire.cli import main
from thinwire.comm import paced as paced_module
from thinwire.compress.base import Slot, run_locally
from thinwire.compress.none import NoCompression
from thinwire.plan import (
    ALLGATHER,
    ALLREDUCE,
    ALLTOALL,
    DIRECT,
    PACED,
    BucketCost,
    Collective,
    ComputeTime,
    Link,
    MethodCost,
    break_even_bandwidth,
    broadcast_time,
    collective_time,
    ddp_buckets,
    measure_compute,
    measure_method,
    predict_step,
    profile_model,
    step_time,
)
from thinwire.plan.embedding import TableLookups, measure_lookups, table_traffic
from thinwire.plan.network import paced_steps
from thinwire.strategies import strategy

pytestmark = [pytest.mark.timeout(120)]

MBYTE_PER_S = 8e6  # bits per second that move 1e6 bytes per second


def bare(bandwidth_bps: float, latency_s: float = 0.0) -> Link:
    """The textbook link (alpha = one-way latency, no headers), for hand-computed cases."""
    return Link(bandwidth_bps, latency_s, header_bytes=0, step_delays=1, store_and_forward=False)


def one_bucket(method: str, kind: str, nbytes: int, compress_s: float = 0.0) -> MethodCost:
    return MethodCost(method, (BucketCost(1.0, compress_s, (Collective(kind, nbytes),)),))


# -- alpha-beta -----------------------------------------------------------------------------


def test_allreduce_and_allgather_times_by_hand() -> None:
    link = bare(MBYTE_PER_S, 0.001)
    # ring all-reduce, 4 ranks, 1 MB: 2*3 latency steps + 2*3/4 * 1 s
    assert collective_time(ALLREDUCE, 1e6, 4, link) == pytest.approx(0.006 + 1.5)
    # ring all-gather, 4 ranks, 1 MB each: 3 latency steps + 3 * 1 s
    assert collective_time(ALLGATHER, 1e6, 4, link) == pytest.approx(0.003 + 3.0)
    assert collective_time(ALLREDUCE, 1e6, 1, link) == 0.0  # one rank sends nothing
    assert collective_time(ALLGATHER, 0, 8, link) == 0.0
    # direct (all-to-all), 4 ranks, 1 MB each: one latency step, the all-gather's bytes
    assert collective_time(DIRECT, 1e6, 4, link) == pytest.approx(0.001 + 3.0)
    far = bare(1e9, 0.05)  # long round trips: a small payload's time is its latency steps
    assert collective_time(DIRECT, 4000, 4, far) < collective_time(ALLREDUCE, 4000, 4, far) / 5


def test_default_link_counts_headers_handshake_and_switch() -> None:
    link = Link(MBYTE_PER_S, 0.001)  # 1500-byte packets with 52 bytes of TCP/IPv4 headers
    assert link.overhead == pytest.approx(1500 / 1448)
    # gloo's ready handshake (2 one-way latencies) + the switch holding one 1500-byte packet
    assert link.step_latency_s == pytest.approx(2 * 0.001 + 1500 / 1e6)
    assert collective_time(ALLREDUCE, 1e6, 2, link) == pytest.approx(2 * 0.0035 + 1500 / 1448)
    assert collective_time(ALLGATHER, 1e6, 4, link) == pytest.approx(3 * 0.0035 + 3 * 1500 / 1448)


def test_allgather_grows_with_workers_allreduce_bandwidth_term_does_not() -> None:
    link = bare(MBYTE_PER_S)
    reduce = [collective_time(ALLREDUCE, 1e6, n, link) for n in (2, 4, 16, 100)]
    gather = [collective_time(ALLGATHER, 1e6, n, link) for n in (2, 4, 16, 100)]
    assert reduce == pytest.approx([1.0, 1.5, 1.875, 1.98])
    assert all(t < 2.0 for t in reduce)  # bounded by 2 * bytes / B
    assert gather == pytest.approx([1.0, 3.0, 15.0, 99.0])  # linear in N


def test_bad_numbers_are_named() -> None:
    with pytest.raises(ValueError, match="bandwidth must be > 0 bits/s, got -5"):
        Link(-5)
    with pytest.raises(ValueError, match="latency must be >= 0 s"):
        Link(1e6, -0.1)
    with pytest.raises(ValueError, match=r"world size .* >= 1, got 0"):
        collective_time(ALLREDUCE, 10, 0, bare(1e6))
    with pytest.raises(ValueError, match="unknown collective kind 'broadcast'"):
        collective_time("broadcast", 10, 2, bare(1e6))
    with pytest.raises(ValueError, match=r"ready fraction must be in \[0, 1\], got 1\.5"):
        BucketCost(1.5, 0.0, ())


# -- the step timeline ----------------------------------------------------------------------


def test_timeline_overlaps_network_with_backward_by_hand() -> None:
    compute = ComputeTime(forward_s=1.0, backward_s=2.0, optimizer_s=0.5)
    link = bare(MBYTE_PER_S)  # all-reduce over 2 ranks: 1e6 bytes take 1 s
    cost = MethodCost(
        "x",
        (
            BucketCost(0.5, 0.0, (Collective(ALLREDUCE, 1_000_000),)),  # ready at t=2
            BucketCost(1.0, 0.0, (Collective(ALLREDUCE, 500_000),)),  # ready at t=3
        ),
    )
    # bucket 1: 2 -> 3; bucket 2: 3 -> 3.5; optimizer after: 4.0
    assert step_time(compute, cost, link, 2) == pytest.approx(4.0)
    # no overlap: both start after the backward pass: 3 -> 4 -> 4.5, + 0.5
    assert step_time(compute, cost, link, 2, overlap=False) == pytest.approx(5.0)
    # compression never hides: 0.25 s on bucket 1 delays the backward pass and its send
    slow = MethodCost("y", (BucketCost(0.5, 0.25, cost.buckets[0].collectives), cost.buckets[1]))
    assert step_time(compute, slow, link, 2) == pytest.approx(4.25)
    prediction = predict_step(compute, slow, link, 2)
    assert prediction.compute_s == pytest.approx(3.5)
    assert prediction.comm_s == pytest.approx(1.5)
    assert prediction.efficiency == pytest.approx(3.5 / 4.25)
    local = predict_step(compute, MethodCost("local"), link, 2)
    assert local.step_s == pytest.approx(3.5) and local.efficiency == 1.0


def test_ddps_buffer_broadcast_delays_the_whole_step_by_hand() -> None:
    link = bare(MBYTE_PER_S, latency_s=0.01)  # 1e5 bytes take 0.1 s
    # gloo's root sends a copy to each other rank over its own link
    assert broadcast_time(100_000, 2, link) == pytest.approx(0.11)
    assert broadcast_time(100_000, 4, link) == pytest.approx(0.31)
    assert broadcast_time(100_000, 5, link) == pytest.approx(0.41)
    assert broadcast_time(100_000, 1, link) == 0.0 and broadcast_time(0, 4, link) == 0.0
    with pytest.raises(ValueError, match="a broadcast cannot carry -1 bytes"):
        broadcast_time(-1, 4, link)
    compute = ComputeTime(forward_s=1.0, backward_s=2.0, optimizer_s=0.5)
    plain = one_bucket("x", ALLREDUCE, 1_000_000)  # 2 ranks: 2 steps of 0.01 s and 1 s
    with_buffers = MethodCost("x", plain.buckets, broadcast_bytes=100_000)
    assert step_time(compute, plain, link, 2) == pytest.approx(3.0 + 1.02 + 0.5)
    assert step_time(compute, with_buffers, link, 2) == pytest.approx(0.11 + 3.0 + 1.02 + 0.5)
    assert with_buffers.collectives == plain.collectives + 1
    assert with_buffers.sent_bytes(4) == pytest.approx(plain.sent_bytes(4) + 0.75 * 100_000)
    assert with_buffers.comm_time(2, link) == pytest.approx(plain.comm_time(2, link) + 0.11)


def test_only_methods_under_ddp_pay_for_the_buffer_broadcast() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.BatchNorm1d(32), nn.Linear(32, 10))
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())  # means, vars, count
    batch = (torch.randn(16, 64), torch.randint(0, 10, (16,)))
    methods = {"local": {}, "dense": {}, "powersgd": {}, "dga": {}}
    profile = profile_model(
        model, batch, nn.functional.cross_entropy, methods, world_size=4, repeats=1
    )
    assert {n: c.broadcast_bytes for n, c in profile.costs.items()} == {
        "local": 0,
        "dense": buffers,
        "powersgd": buffers,
        "dga": 0,
    }
    off = profile_model(
        model,
        batch,
        nn.functional.cross_entropy,
        methods,
        world_size=4,
        repeats=1,
        broadcast_buffers=False,
    )
    assert all(c.broadcast_bytes == 0 for c in off.costs.values())


def test_delayed_averaging_hides_latency_behind_compute_by_hand() -> None:
    compute = ComputeTime(forward_s=0.2, backward_s=0.6, optimizer_s=0.0)  # 0.8 s
    link = bare(MBYTE_PER_S, latency_s=0.1)  # 4 ranks: 6 ring steps of 0.1 s
    bucket = BucketCost(1.0, 0.0, (Collective(ALLREDUCE, 400_000),))  # 0.6 s of bytes

    def dga(delay: int, lanes: int) -> MethodCost:
        return MethodCost("dga", (bucket,), 0, {"delay": delay, "lanes": lanes}, schedule="dga")

    # one exchange: 0.6 s of latency + 2*3/4*0.4e6 bytes = 0.6 s of bandwidth = 1.2 s
    assert step_time(compute, dga(0, 1), link, 4) == pytest.approx(0.8 + 1.2)
    assert step_time(compute, dga(2, 1), link, 4) == pytest.approx(1.2)  # one at a time
    assert step_time(compute, dga(2, 2), link, 4) == pytest.approx(0.8)  # 0.6 s each
    # lanes beyond the delay do not help; the bandwidth bound stays
    assert step_time(compute, dga(1, 4), link, 4) == pytest.approx(1.2)
    thin = bare(MBYTE_PER_S / 2, latency_s=0.1)  # the bytes alone now take 1.2 s a step
    assert step_time(compute, dga(4, 4), thin, 4) == pytest.approx(1.2)


def test_local_sgd_and_diloco_rounds_by_hand() -> None:
    compute = ComputeTime(forward_s=0.2, backward_s=0.6, optimizer_s=0.0)  # 0.8 s
    link = bare(MBYTE_PER_S, latency_s=0.1)  # one exchange of 400 kB on 4 ranks: 1.2 s
    bucket = BucketCost(1.0, 0.4, (Collective(ALLREDUCE, 400_000),))  # 0.4 s to compress

    def rounds(sync_every: int, fragments: int = 1, overlap: int = 0) -> MethodCost:
        options = {"sync_every": sync_every, "fragments": fragments, "overlap": overlap}
        return MethodCost("diloco", (bucket,), 1_600_000, options, schedule="local")

    # synchronous: the round's compression and exchange once every H steps
    assert step_time(compute, rounds(1), link, 4) == pytest.approx(0.8 + 1.6)
    assert step_time(compute, rounds(8), link, 4) == pytest.approx(0.8 + 1.6 / 8)
    # 2 fragments, each 0.6 s of latency and 0.3 s of bytes: synchronous, both stop
    assert step_time(compute, rounds(8, 2), link, 4) == pytest.approx(0.8 + (0.4 + 1.8) / 8)
    # overlapped, each behind 1 step of 0.8 s: 0.1 s of each shows
    assert step_time(compute, rounds(8, 2, 1), link, 4) == pytest.approx(0.8 + (0.4 + 0.2) / 8)
    # behind 2 steps, all of it hides: only compression shows
    assert step_time(compute, rounds(8, 2, 2), link, 4) == pytest.approx(0.8 + 0.4 / 8)
    # a link too slow to carry a round's bytes in its H steps: the bytes set the pace
    slow = bare(MBYTE_PER_S / 100, latency_s=0.0)  # 60 s of bytes a round
    assert step_time(compute, rounds(8, 2, 7), slow, 4) == pytest.approx(60.0 / 8)
    # per step, a round's bytes are spread over its H steps
    prediction = predict_step(compute, rounds(8), link, 4)
    assert prediction.payload_bytes == 50_000
    assert prediction.compression_ratio == pytest.approx(32.0)


def test_parameter_server_step_by_hand() -> None:
    compute = ComputeTime(forward_s=0.5, backward_s=0.5)
    link = bare(MBYTE_PER_S, latency_s=0.05)  # 1e6 bytes/s, alpha = 0.05 s

    def server(schedule: str, servers: int) -> MethodCost:
        pushes = (BucketCost(1.0, 0.0, (Collective(ALLREDUCE, 200_000),)),)
        return MethodCost(schedule, pushes, 400_000, {"servers": servers}, schedule=schedule)

    # 4 workers, 1 shard: the shard's link takes 3 pushes (0.6 s) and sends 3 pulls (1.2 s)
    assert step_time(compute, server("ps-sync", 1), link, 4) == pytest.approx(1.0 + 0.1 + 0.6 + 1.2)
    # 2 shards halve what each shard's link carries (but a worker still pulls 0.4 s)
    assert step_time(compute, server("ps-sync", 2), link, 4) == pytest.approx(1.0 + 0.1 + 0.3 + 0.6)
    # asynchronous: a worker's own cycle (1.0 + 0.1 + 0.2 + 0.4) or the shard's link
    assert step_time(compute, server("ps-async", 1), link, 4) == pytest.approx(1.7)
    assert step_time(compute, server("ps-async", 4), link, 4) == pytest.approx(1.7)
    slow = bare(MBYTE_PER_S / 4, latency_s=0.05)  # the shard's pulls now take 4.8 s
    assert step_time(compute, server("ps-async", 1), slow, 4) == pytest.approx(4.8)


def test_predicted_step_is_monotone_in_bandwidth() -> None:
    compute = ComputeTime(0.1, 0.3, 0.05)
    cost = MethodCost(
        "m",
        (
            BucketCost(0.3, 0.01, (Collective(ALLGATHER, 40_000), Collective(ALLREDUCE, 9000))),
            BucketCost(1.0, 0.02, (Collective(ALLREDUCE, 2_000_000),)),
        ),
    )
    steps = [step_time(compute, cost, Link(b, 0.001), 4) for b in [1e5 * 1.5**i for i in range(40)]]
    assert all(a >= b for a, b in itertools.pairwise(steps))
    assert steps[0] > steps[-1] >= compute.total + cost.compress_s


def test_break_even_bandwidth_by_hand() -> None:
    compute = ComputeTime(0.0, 0.0, 0.0)
    dense = one_bucket("dense", ALLREDUCE, 1_000_000)
    squeezed = one_bucket("squeezed", ALLREDUCE, 1_000, compress_s=1.0)
    # 2 ranks: dense takes 8e6/B s, squeezed 1 + 8e3/B s; equal at B = 7.992e6 bit/s
    verdict = break_even_bandwidth(compute, squeezed, dense, 0.0, 2, link=bare(1.0))
    assert verdict.verdict == "below"
    assert verdict.bandwidth_bps == pytest.approx(7.992e6, rel=2e-3)
    assert verdict.describe() == "< 7.99 Mbit/s"
    # slower to compress than to send, and no fewer bytes: never pays off
    costly = one_bucket("costly", ALLREDUCE, 1_000_000, compress_s=1.0)
    assert break_even_bandwidth(compute, costly, dense, 0.0, 2).verdict == "never"
    # free compression, fewer bytes: faster at every bandwidth searched
    free = one_bucket("free", ALLREDUCE, 1_000)
    assert break_even_bandwidth(compute, free, dense, 0.001, 2).verdict == "always"


# -- profiling ------------------------------------------------------------------------------


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(256, 512)
        self.second = nn.Linear(512, 512)
        self.last = nn.Linear(512, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(torch.relu(self.second(torch.relu(self.first(x)))))


def named(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(n, p.detach()) for n, p in model.named_parameters()]


def test_ddp_buckets_fill_in_ready_order_with_a_small_first_bucket() -> None:
    params = named(Net())  # 0.13 M + 0.26 M + 5 k weights
    buckets = ddp_buckets(params)
    # reverse order: last.bias, last.weight, second.bias, second.weight (>= 1 MiB: closes)
    assert buckets == [
        ["last.bias", "last.weight", "second.bias", "second.weight"],
        ["first.bias", "first.weight"],
    ]
    assert ddp_buckets(params, bucket_cap_mb=0.5, first_bucket_mb=1e-5)[0] == ["last.bias"]
    with pytest.raises(ValueError, match="order must name each of the 6 parameters"):
        ddp_buckets(params, ["last.bias"])


def test_measure_compute_times_phases_and_gradient_readiness() -> None:
    torch.manual_seed(0)
    model = Net()
    batch = (torch.randn(16, 256), torch.randint(0, 10, (16,)))
    profile = measure_compute(model, batch, nn.functional.cross_entropy, repeats=3, warmup=1)
    assert profile.time.forward_s > 0 and profile.time.backward_s > 0
    assert set(profile.ready) == {n for n, _ in named(model)}
    assert all(0.0 <= r <= 1.0 for r in profile.ready.values())
    assert profile.ready["last.weight"] <= profile.ready["first.weight"]
    assert profile.order.index("last.weight") < profile.order.index("first.weight")


def engine_bytes(compressor: thinwire.Compressor, params, world: int, step: int) -> int:
    """What thinwire's engine would contribute per step, tensor by tensor via run_locally."""
    total = 0
    for name, p in params:
        grad = torch.randn(p.shape)
        chosen = compressor if compressor.compresses(grad) else NoCompression()
        wire: list[int] = []
        run_locally(chosen.exchange(grad, Slot(name, step, world)), wire_bytes=wire)
        total += sum(wire)
    return total


@pytest.mark.parametrize(
    ("method", "options"),
    [
        ("dgc", {"density": 0.01, "warmup_steps": 5}),
        ("topk", {"density": 0.05}),
        ("onebit", {}),
        ("powersgd", {"rank": 2}),
        ("fp16", {}),
        ("none", {}),
    ],
)
def test_thinwire_traffic_matches_the_engine(method: str, options: dict) -> None:
    params = named(Net())
    cost = measure_method(
        method, params, world_size=4, options=options, repeats=1, fuse_rounds=False
    )
    steady = options.get("warmup_steps", 0)  # past DGC's warm-up
    expected = engine_bytes(thinwire.compressor(method, **options), params, 4, steady)
    gathers = sum(c.kind == ALLGATHER for b in cost.buckets for c in b.collectives)
    assert cost.payload_bytes == expected + gathers  # + one status byte per all-gather
    assert len(cost.buckets) == 2
    assert cost.dense_bytes == sum(p.numel() * 4 for _, p in params)
    kinds = {c.kind for b in cost.buckets for c in b.collectives}
    summable = thinwire.compressor(method).aggregation is thinwire.compress.Aggregation.SUM
    assert kinds == ({ALLREDUCE} if summable else {ALLGATHER})
    rounds = 2 if method == "powersgd" else 1
    if method != "fp16":  # fp16 payloads and fp32 biases: two dtypes, two all-reduces
        assert all(len(b.collectives) == rounds for b in cost.buckets)


def test_traffic_that_alternates_between_steps_is_modelled_at_the_heavier_step() -> None:
    params = named(Net())
    options = {"rank": 2, "alternate": True}
    comp = thinwire.compressor("powersgd-oneround", **options)
    per_step = [engine_bytes(comp, params, 4, step) for step in range(2)]  # P, then Q
    assert per_step[0] != per_step[1]
    modelled = [
        measure_method(
            "powersgd-oneround", params, world_size=4, options=options, repeats=repeats
        ).payload_bytes
        for repeats in (2, 3)
    ]
    assert modelled == [max(per_step)] * 2


def test_fused_rounds_move_a_buckets_second_round_into_the_next_buckets_first() -> None:
    params = named(Net())

    def cost(method: str, options: dict, fuse: bool) -> MethodCost:
        return measure_method(
            method, params, world_size=4, options=options, repeats=1, fuse_rounds=fuse
        )

    alone, fused = (cost("powersgd", {"rank": 2}, fuse) for fuse in (False, True))
    (p0, q0), (p1, q1) = (b.collectives for b in alone.buckets)
    assert [[c.nbytes for c in b.collectives] for b in fused.buckets] == [
        [p0.nbytes],
        [q0.nbytes + p1.nbytes, q1.nbytes],
    ]
    assert fused.payload_bytes == alone.payload_bytes and fused.collectives == 3
    one_round = [cost("dgc", {"density": 0.01}, fuse) for fuse in (False, True)]
    assert [b.collectives for b in one_round[0].buckets] == [
        b.collectives for b in one_round[1].buckets
    ]


def test_communicator_option_picks_the_collectives_and_is_checked() -> None:
    params = named(Net())

    def kinds(method: str, options: dict) -> set[str]:
        cost = measure_method(method, params, world_size=4, options=options, repeats=1)
        return {c.kind for b in cost.buckets for c in b.collectives}

    assert kinds("powersgd", {"rank": 2}) == {ALLREDUCE}
    assert kinds("powersgd", {"rank": 2, "communicator": "direct"}) == {DIRECT}
    assert kinds("dgc", {"density": 0.01, "communicator": "direct"}) == {DIRECT}
    assert kinds("dgc", {"density": 0.01}) == {ALLGATHER}
    with pytest.raises(ValueError, match="communicator must be one of"):
        strategy("powersgd").options({"communicator": "ring"})
    with pytest.raises(ValueError, match="cannot run on communicator 'allreduce'"):
        strategy("dgc").options({"communicator": "allreduce"})


def test_dgc_compresses_large_matrices_about_500x() -> None:
    params = [("w", torch.zeros(1000, 1000))]
    cost = measure_method("dgc", params, world_size=4, options={"density": 0.001}, repeats=1)
    # k = 1000 values + int32 indices = 8000 bytes, + the status byte of the all-gather
    assert cost.payload_bytes == 8001
    assert cost.compression_ratio == pytest.approx(500, rel=0.01)
    assert cost.compress_s > 0


def test_profile_predicts_with_a_measured_compute_time() -> None:
    torch.manual_seed(0)
    model = Net()
    batch = (torch.randn(16, 256), torch.randint(0, 10, (16,)))
    methods = {"local": {}, "dense": {}, "dgc": {"density": 0.01}}
    profile = profile_model(
        model, batch, nn.functional.cross_entropy, methods, world_size=4, repeats=2
    )
    link = Link(10e6, 0.001)
    dense = profile.predict("dense", link)
    assert dense.comm_s == pytest.approx(profile.costs["dense"].comm_time(4, link))
    assert profile.predict("local", link).efficiency == 1.0
    # a measured compute 3x the profiled one: compression slows down by 3x too
    slow = profile.compute.time.scaled(3.0)
    dgc = profile.predict("dgc", link, compute=slow)
    assert dgc.compute_s == pytest.approx(slow.total)
    assert dgc.compress_s == pytest.approx(3 * profile.costs["dgc"].compress_s)
    as_total = profile.predict("dgc", link, compute=slow.total)  # a measured step time
    assert as_total.step_s == pytest.approx(dgc.step_s)
    with pytest.raises(ValueError, match="method 'topk' was not profiled"):
        profile.predict("topk", link)
    # workers whose compute is not on their CPU (sleeps, an accelerator): the compression
    # follows the CPU's own factor, not the compute's
    fast = profile.compute.time.scaled(0.02)
    virtual = profile.predict("dgc", link, compute=fast, cpu_scale=1.5)
    assert virtual.compute_s == pytest.approx(fast.total)
    assert virtual.compress_s == pytest.approx(1.5 * profile.costs["dgc"].compress_s)
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="cpu_scale must be a finite factor > 0"):
            profile.predict("dgc", link, cpu_scale=bad)


def test_pytorch_hook_traffic() -> None:
    params = named(Net())
    dense = measure_method("dense", params, world_size=4, repeats=1)
    assert [len(b.collectives) for b in dense.buckets] == [1, 1]
    assert dense.payload_bytes == dense.dense_bytes and dense.compress_s == 0
    half = measure_method("ddp-fp16", params, world_size=4, repeats=1)
    assert half.payload_bytes * 2 == dense.dense_bytes
    low = measure_method("ddp-powersgd", params, world_size=4, options={"rank": 2}, repeats=1)
    # one bucket (as thinwire bench runs the hook on gloo): the 1-D tensors 10 + 512 + 512
    # dense; P: last.weight 10x512 -> 10x2, the 512x512 -> 512x2, first.weight 512x256 ->
    # 512x2; Q: 512x2 + 512x2 + 256x2
    assert len(low.buckets) == 1
    assert [c.nbytes for c in low.buckets[0].collectives] == [
        4 * 1034,
        4 * (20 + 1024 + 1024),
        4 * (1024 + 1024 + 512),
    ]
    assert measure_method("local", params, world_size=4).buckets == ()


def test_method_table() -> None:
    assert strategy("local").costing == "none"
    assert strategy("dense").costing == "dense"
    assert strategy("ddp-powersgd").costing == "torch-powersgd"
    assert strategy("dgc").costing == "thinwire"
    with pytest.raises(ValueError, match="unknown method 'zip'; choose one of: local, dense"):
        strategy("zip")
    assert strategy("ddp-powersgd").options({"rank": 4})["matrix_approximation_rank"] == 4
    with pytest.raises(ValueError, match="method 'dense' has no option"):
        strategy("dense").options({"rank": 4})
    with pytest.raises(ValueError, match="density"):
        strategy("dgc").options({"density": 2.0})
    # the error names the option as the user spelled it
    with pytest.raises(ValueError, match=r"ddp-powersgd: rank must be an integer >= 1, got 0"):
        strategy("ddp-powersgd").options({"rank": 0})
    with pytest.raises(ValueError, match=r"matrix_approximation_rank must be .*, got 2\.5"):
        strategy("ddp-powersgd").options({"matrix_approximation_rank": 2.5})


# -- the command ----------------------------------------------------------------------------


def test_plan_command_on_digits(tmp_path, capsys) -> None:
    try:
        from thinwire.tasks import task  # noqa: F401
    except ImportError as error:
        pytest.skip(f"thinwire.tasks.task is not importable yet: {error}")
    out = tmp_path / "plan.json"
    argv = [
        "plan",
        "--task",
        "digits",
        "--workers",
        "4",
        "--bandwidth",
        "10mbit",
        "--latency",
        "1ms",
        "--methods",
        "local,dense,dgc",
        "--json",
        str(out),
    ]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    for text in ("thinwire plan: digits, 4 workers, 10 Mbit/s", "dense", "dgc", "beats dense"):
        assert text in printed
    data = json.loads(out.read_text())
    rows = {m["method"]: m for m in data["methods"]}
    assert set(rows) == {"local", "dense", "dgc"}
    assert rows["local"]["efficiency"] == 1.0 and rows["local"]["compression_ratio"] is None
    assert rows["dgc"]["step_s"] < rows["dense"]["step_s"]
    assert rows["dgc"]["payload_bytes"] < rows["dense"]["payload_bytes"] / 50
    assert math.isclose(data["bandwidth_bps"], 10e6)


def test_plan_command_models_ddps_buckets_and_buffer_broadcast(tmp_path, capsys) -> None:
    base = ["plan", "--task", "fashion", "--workers", "4", "--bandwidth", "10mbit"]
    base += ["--latency", "1ms", "--task-options", '{"batch_size": 8, "width": 8}']
    runs = {}
    for name, extra in {
        "default": [],
        "quiet": ["--no-broadcast-buffers"],
        "small": ["--bucket-cap-mb", "0.5", "--no-broadcast-buffers"],
    }.items():
        out = tmp_path / f"{name}.json"
        assert main([*base, "--methods", "dense", *extra, "--json", str(out)]) == 0
        runs[name] = json.loads(out.read_text())
    capsys.readouterr()
    assert runs["default"]["broadcast_buffers"] is True
    assert runs["quiet"]["broadcast_buffers"] is False
    assert runs["small"]["bucket_cap_mb"] == 0.5
    assert runs["default"]["task_options"] == {"batch_size": 8, "width": 8}
    dense = {name: run["methods"][0] for name, run in runs.items()}
    # the broadcast is one more collective, before the forward pass
    assert dense["default"]["collectives"] == dense["quiet"]["collectives"] + 1
    assert dense["small"]["collectives"] > dense["quiet"]["collectives"]  # more buckets


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--workers", "0", "--bandwidth", "10mbit"], "--workers must be an integer >= 1, got 0"),
        (["--workers", "4", "--bandwidth", "fast"], "bandwidth 'fast' is not understood"),
        (["--workers", "4", "--bandwidth", "unlimited"], "--bandwidth must be a finite rate"),
        (["--workers", "4", "--bandwidth", "1gbit", "--latency", "soon"], "latency 'soon'"),
        (["--workers", "4", "--bandwidth", "1gbit", "--methods", "zip"], "unknown method 'zip'"),
        (["--workers", "4", "--bandwidth", "1gbit", "--options", "{"], "--options is not valid"),
        (["--workers", "4", "--bandwidth", "1gbit", "--task-options", "[1]"], "a JSON object"),
        # found before the plan runs (it printed the table, then a bare IsADirectoryError)
        (["--workers", "4", "--bandwidth", "1gbit", "--json", "."], "--json . is a directory"),
    ],
)
def test_plan_command_rejects_bad_input(flags: list[str], message: str, capsys) -> None:
    assert main(["plan", "--task", "digits", *flags]) == 2
    assert message in capsys.readouterr().err


# -- the embedding methods ---------------------------------------------------------------------


class _Bag(nn.Module):
    """A table of 12 rows x 5 and a head: the smallest model with a lookup."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(12, 5)
        self.head = nn.Linear(5, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embedding(ids).mean(dim=1))


def test_lookups_count_distinct_ids_per_rank_and_per_owner_by_hand() -> None:
    # 2 ranks, owner = id % 2; step 0: rank 0 looks up {0, 1, 2, 3} (ids repeated), rank 1
    # {1, 3, 5}; step 1: rank 0 {4}, rank 1 {0, 2, 4, 6, 8, 10}
    batches = [
        [torch.tensor([[0, 1, 2, 3, 3, 0]]), torch.tensor([[1, 3, 5, 5, 5, 1]])],
        [torch.tensor([[4, 4, 4, 4, 4, 4]]), torch.tensor([[0, 2, 4, 6, 8, 10]])],
    ]
    (table,) = measure_lookups(_Bag(), batches, world_size=2)
    assert (table.name, table.rows, table.dim) == ("embedding.weight", 12, 5)
    assert table.unique == pytest.approx((4 + 3 + 1 + 6) / 4)
    assert table.largest == pytest.approx((4 + 6) / 2)
    # ids owned by the other rank: at step 0 rank 0 needs {1, 3} from rank 1, rank 1 none
    # (1, 3, 5 are its own); at step 1 rank 0 none, rank 1 all six (even: rank 0's)
    assert table.per_peer == pytest.approx((2 + 0 + 0 + 6) / 4)
    with pytest.raises(ValueError, match=r"no nn\.Embedding layers"):
        measure_lookups(nn.Linear(3, 3), batches, world_size=2)


def test_lookups_refuse_what_the_embedding_methods_refuse() -> None:
    batches = [[torch.tensor([[0, 1]]), torch.tensor([[2, 3]])]]
    tied = _Bag()
    tied.head = nn.Linear(5, 12)
    tied.head.weight = tied.embedding.weight  # a tied output projection
    with pytest.raises(ValueError, match="shares its weight"):
        measure_lookups(tied, batches, world_size=2)
    padded = _Bag()
    padded.embedding = nn.Embedding(12, 5, padding_idx=0)
    with pytest.raises(ValueError, match="uses padding_idx"):
        measure_lookups(padded, batches, world_size=2)

    class Twice(_Bag):
        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return super().forward(ids) + super().forward(ids)

    with pytest.raises(ValueError, match="looked up 2 times in one forward pass"):
        measure_lookups(Twice(), batches, world_size=2)

    class Unused(_Bag):
        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(torch.zeros(ids.shape[0], 5))

    (table,) = measure_lookups(Unused(), batches, world_size=2)
    assert (table.unique, table.largest, table.per_peer) == (0.0, 0.0, 0.0)


def test_table_traffic_of_the_sharded_and_gathered_tables_by_hand() -> None:
    table = TableLookups("e.weight", rows=1000, dim=16, unique=100.0, largest=120.0, per_peer=30.0)
    sharded = table_traffic("emb-sharded", [table], {"prefetch": True}, world_size=4)
    # rows of 16 fp32 = 64 bytes: 30 rows and a status row to each of 3 peers, 30 row
    # gradients to each; one int64 count and 30 ids to each
    assert sharded.forward == (Collective(ALLTOALL, 3 * 31 * 64),)
    assert sharded.backward == (Collective(ALLTOALL, 3 * 30 * 64),)
    assert sharded.background == (Collective(ALLTOALL, 3 * 8), Collective(ALLTOALL, 3 * 30 * 8))
    unfetched = table_traffic("emb-sharded", [table], {"prefetch": False}, world_size=4)
    assert unfetched.forward == (*sharded.background, *sharded.forward)
    assert unfetched.background == ()
    gathered = table_traffic("emb-allgather", [table], {}, world_size=4)
    assert gathered.forward == () and gathered.background == ()
    # every rank's part padded to the largest: 120 x (8-byte id + 64-byte row)
    assert gathered.backward == (Collective(ALLGATHER, 8), Collective(ALLGATHER, 120 * 72))
    # an all-to-all's bytes are what a rank sends to all its peers, in one latency
    link = bare(MBYTE_PER_S, latency_s=0.01)
    assert collective_time(ALLTOALL, 300_000, 4, link) == pytest.approx(0.01 + 0.3)
    # paced, the same bytes take a latency per window of partners (comm.paced's rule)
    assert collective_time(PACED, 3_000, 4, link) == pytest.approx(0.01 + 0.003)
    per_peer, budget = 100_000, 128 * 1024  # over half the budget: one partner at a time
    assert paced_steps(3 * per_peer, 4, budget) == 3
    assert paced_steps(15 * 57_000, 16, budget) == 8  # 57 kB a partner: two at a time
    assert paced_steps(15 * 57_000, 16, budget=0) == 1  # pacing off: all at once
    saved = paced_module.PACE_BYTES
    try:  # the model follows the transport's setting
        paced_module.PACE_BYTES = budget
        assert collective_time(PACED, 300_000, 4, link) == pytest.approx(3 * 0.01 + 0.3)
        paced_module.PACE_BYTES = 0
        assert collective_time(PACED, 300_000, 4, link) == pytest.approx(0.01 + 0.3)
    finally:
        paced_module.PACE_BYTES = saved
    with pytest.raises(ValueError, match="prefetches the next batch's ids for one table"):
        table_traffic("emb-sharded", [table, table], {"prefetch": True}, world_size=4)


def test_a_forward_lookup_lengthens_the_forward_pass_and_background_traffic_does_not() -> None:
    link = bare(MBYTE_PER_S, latency_s=0.01)  # 1e5 bytes take 0.1 s
    compute = ComputeTime(forward_s=1.0, backward_s=2.0, optimizer_s=0.5)
    plain = one_bucket("x", ALLREDUCE, 1_000_000)  # 2 ranks: 2 steps of 0.01 s and 1 s
    fetched = MethodCost(
        "x",
        plain.buckets,
        forward_collectives=(Collective(DIRECT, 100_000),),  # 0.01 s + 0.1 s
        background_collectives=(Collective(DIRECT, 50_000),),
    )
    assert step_time(compute, plain, link, 2) == pytest.approx(3.0 + 1.02 + 0.5)
    assert step_time(compute, fetched, link, 2) == pytest.approx(0.11 + 3.0 + 1.02 + 0.5)
    assert fetched.payload_bytes == plain.payload_bytes + 150_000
    assert fetched.collectives == plain.collectives + 2
    assert fetched.comm_time(2, link) == pytest.approx(plain.comm_time(2, link) + 0.11 + 0.06)


def test_embedding_methods_send_the_tables_traffic_and_ddp_the_rest() -> None:
    model = _Bag()
    params = [(n, p.detach()) for n, p in model.named_parameters()]
    table = TableLookups("embedding.weight", 12, 5, unique=6.0, largest=7.0, per_peer=2.0)
    with pytest.raises(ValueError, match="profile it with its task"):
        measure_method("emb-sharded", params, world_size=2)
    dense = measure_method("dense", params[1:], world_size=2)  # the head alone
    for method in ("emb-sharded", "emb-allgather"):
        cost = measure_method(method, params, world_size=2, lookups=[table])
        traffic = table_traffic(method, [table], {"prefetch": True}, world_size=2)
        assert cost.buckets[:-1] == dense.buckets
        assert cost.buckets[-1].collectives == traffic.backward
        assert cost.forward_collectives == traffic.forward
        assert cost.background_collectives == traffic.background
        assert cost.dense_bytes == sum(p.numel() * 4 for _, p in params)
    sharded = measure_method("emb-sharded", params, world_size=2, lookups=[table])
    assert len(sharded.forward_collectives) == 1 and len(sharded.background_collectives) == 2
    compressed = measure_method(
        "emb-sharded",
        params,
        world_size=2,
        options={"compressor": "fp16"},
        lookups=[table],
    )
    assert compressed.buckets[0].collectives[0].nbytes == dense.payload_bytes // 2


def test_the_packages_tasks_embedding_methods_are_profiled_from_its_batches() -> None:
    from thinwire.plan.profile import profile_task
    from thinwire.tasks import task

    profile = profile_task(
        task("packages", vocab_size=2048, batch_size=8),
        {"dense": None, "emb-sharded": None, "emb-allgather": None},
        world_size=4,
        repeats=1,
        method_repeats=1,
    )
    link = Link(100e6, 1e-3)
    dense, sharded, gathered = (
        profile.predict(m, link) for m in ("dense", "emb-sharded", "emb-allgather")
    )
    assert sharded.sent_bytes < gathered.sent_bytes < dense.sent_bytes / 4
    assert sharded.step_s < dense.step_s


def test_the_plan_refuses_what_the_library_would_refuse() -> None:
    """It once predicted 5 servers for 2 workers, and dga with a stateful compressor on
    2 lanes, both of which the library refuses."""
    from thinwire.plan.report import parse_request

    servers = '{"ps-sync": {"servers": 5}}'
    with pytest.raises(ValueError, match=r"ps-sync: 5 server\(s\) for 2 worker\(s\)"):
        parse_request("digits", 2, "100mbit", "1ms", "ps-sync", servers)
    lanes = '{"dga": {"compressor": "topk", "lanes": 2}}'
    with pytest.raises(ValueError, match="compressor 'topk' carries state"):
        parse_request("digits", 2, "100mbit", "1ms", "dga", lanes)
    assert parse_request("digits", 2, "100mbit", "1ms", "dga").methods["dga"]["lanes"] == 2

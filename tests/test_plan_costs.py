"""The cost model: alpha-beta formulas, the step timeline, break-even and table traffic."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from thinwire.comm import paced as paced_module
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
    predict_step,
    profile_model,
    step_time,
)
from thinwire.plan.embedding import TableLookups, table_traffic
from thinwire.plan.network import paced_steps

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


# -- the embedding tables' traffic ----------------------------------------------------------


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

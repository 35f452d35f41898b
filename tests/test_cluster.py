"""The emulated cluster: it comes up, carries gloo traffic at its link limits, and leaves
no namespace behind, also when its owner or its forwarder is killed."""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from thinwire.cluster import (
    EmulatedCluster,
    check_can_emulate,
    list_namespaces,
    parse_duration,
    parse_rate,
    remove_leftovers,
)
from thinwire.cluster.forwarder import Downlink, Switch
from thinwire.launch import LocalPool, Placement

REASON = check_can_emulate()
needs_root = pytest.mark.skipif(REASON is not None, reason=f"emulated cluster: {REASON}")
pytestmark = [pytest.mark.timeout(120)]


def _wait_for(condition, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


def test_rates_and_durations_parse_or_say_what_is_wrong() -> None:
    assert parse_rate("10mbit") == 10e6
    assert parse_rate("1Gbit") == 1e9
    assert parse_rate("unlimited") is None
    assert parse_duration("50ms") == pytest.approx(0.05)
    assert parse_duration("200us") == pytest.approx(200e-6)
    with pytest.raises(ValueError, match="10mbit, 100mbit"):
        parse_rate("fast")
    with pytest.raises(ValueError, match="latency"):
        parse_duration("1 fortnight")
    with pytest.raises(ValueError, match="hosts must be"):
        EmulatedCluster(0)


@pytest.mark.skipif(REASON is None, reason="only meaningful without root")
def test_without_root_up_says_why_and_offers_loopback() -> None:
    with pytest.raises(RuntimeError, match="loopback"):
        EmulatedCluster(2).up()


@needs_root
def test_up_creates_hosts_and_down_removes_every_namespace() -> None:
    cluster = EmulatedCluster(3, "100mbit", "1ms")
    with cluster:
        names = list_namespaces()
        assert {h.namespace for h in cluster.hosts} <= set(names)
        assert [h.address for h in cluster.hosts] == ["198.18.0.1", "198.18.0.2", "198.18.0.3"]
        shown = subprocess.run(
            ["ip", "-n", cluster.hosts[1].namespace, "-o", "addr", "show", "tw0"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert "198.18.0.2/24" in shown
        assert _uplink_queue_s(cluster) == pytest.approx(0.010, rel=0.01)  # 10 ms by default
    assert not any(h.namespace in list_namespaces() for h in cluster.hosts)


def _uplink_queue_s(cluster: EmulatedCluster) -> float:
    """Seconds of the link a host's uplink queue (its ``tbf``) holds, as ``tc`` shows it."""
    shown = subprocess.run(
        ["ip", "netns", "exec", cluster.hosts[1].namespace, "tc", "-j", "qdisc", "show", "dev",
         "tw0"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout  # fmt: skip
    (tbf,) = json.loads(shown)
    assert tbf["kind"] == "tbf" and tbf["options"]["rate"] == cluster.rate_bps / 8
    return tbf["options"]["lat"] / 1e6 + tbf["options"]["burst"] / tbf["options"]["rate"]


@needs_root
def test_the_uplink_queue_holds_the_packets_asked_for() -> None:
    with EmulatedCluster(2, "100mbit", "1ms", uplink_queue=256) as cluster:
        packets = _uplink_queue_s(cluster) * cluster.rate_bps / 8 / cluster.mtu
        assert packets == pytest.approx(256, rel=0.01)
    for bad in (0, 1, 10_001, 2.5, True):
        with pytest.raises(ValueError, match="uplink queue is a number of packets"):
            EmulatedCluster(2, "100mbit", "1ms", uplink_queue=bad)  # type: ignore[arg-type]


@needs_root
def test_a_killed_owner_takes_its_cluster_with_it() -> None:
    script = (
        "import os, signal\n"
        "from thinwire.cluster import EmulatedCluster\n"
        "c = EmulatedCluster(2, '10mbit', '1ms', tag='crash1').up()\n"
        "print('up', flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == -signal.SIGKILL and "up" in done.stdout
    assert _wait_for(lambda: not any("crash1" in n for n in list_namespaces()))


@needs_root
def test_a_killed_forwarder_leaves_namespaces_that_the_next_up_removes() -> None:
    cluster = EmulatedCluster(2, "10mbit", "1ms", tag="crash2").up(daemon=True)
    assert cluster.forwarder_pid is not None
    os.kill(cluster.forwarder_pid, signal.SIGKILL)
    cluster.forwarder.wait()  # type: ignore[union-attr]
    assert any("crash2" in n for n in list_namespaces())  # SIGKILL: no chance to clean up
    removed = remove_leftovers()
    assert {h.namespace for h in cluster.hosts} <= set(removed)
    assert not any("crash2" in n for n in list_namespaces())


@needs_root
def test_command_line_up_run_down() -> None:
    thinwire = [sys.executable, "-m", "thinwire.cli"]
    up = subprocess.run(
        [*thinwire, "cluster", "up", "--hosts", "2", "--bandwidth", "50mbit", "--tag", "clitst",
         "--uplink-queue", "64"],
        capture_output=True,
        text=True,
        timeout=60,
    )  # fmt: skip
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        assert "uplink queues of 64 packets" in " ".join(up.stdout.split())
        attached = EmulatedCluster.attach("clitst")
        assert attached.describe()["uplink_queue_packets"] == 64
        packets = _uplink_queue_s(attached) * attached.rate_bps / 8 / attached.mtu
        assert packets == pytest.approx(64, rel=0.01)
        run = subprocess.run(
            [
                *thinwire,
                "cluster",
                "run",
                "--tag",
                "clitst",
                "--",
                sys.executable,
                "-c",
                "import os, sys; sys.stdout.write(f\"rank {os.environ['RANK']} "
                "{os.environ['GLOO_SOCKET_IFNAME']}\\n\")",  # one write: no interleaving
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert run.returncode == 0
        assert "rank 0 tw0" in run.stdout and "rank 1 tw0" in run.stdout
    finally:
        down = subprocess.run(
            [*thinwire, "cluster", "down", "--tag", "clitst"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert down.returncode == 0, down.stdout + down.stderr
    assert not any("clitst" in n for n in list_namespaces())


def _allreduce_timings(rank: int, world_size: int, numel: int) -> dict[str, float]:
    """All-reduce a tensor of ones (checks the sum), then time tiny and large all-reduces."""
    x = torch.ones(numel)
    dist.all_reduce(x)
    tiny = torch.ones(1)
    times = []
    for _ in range(5):
        began = time.perf_counter()
        dist.all_reduce(tiny)
        times.append(time.perf_counter() - began)
    dist.barrier()
    began = time.perf_counter()
    dist.all_reduce(x)
    large = time.perf_counter() - began
    return {
        "sum": float(x[0]),
        "tiny_s": statistics.median(times),
        "large_s": large,
        "ok": bool((x == world_size**2).all()),
    }


@pytest.fixture(scope="module")
def slow_cluster() -> Iterator[EmulatedCluster]:
    if REASON is not None:
        pytest.skip(f"emulated cluster: {REASON}")
    with EmulatedCluster(2, "20mbit", "20ms") as cluster:
        yield cluster


@needs_root
def test_gloo_all_reduce_across_the_cluster_is_correct_and_limited(slow_cluster) -> None:
    numel = 250_000  # 1 MB of fp32: each of 2 ranks sends 1 MB in a ring all-reduce
    with LocalPool(2, placement=Placement.on(slow_cluster)) as pool:
        results = pool.run(_allreduce_timings, numel, timeout=90)
    assert all(r["ok"] for r in results)
    wire_s = 2 * (2 - 1) / 2 * numel * 4 * 8 / 20e6  # bytes each rank sends / link rate
    # the link rate and the delay are enforced: nothing arrives sooner than they allow
    assert min(r["large_s"] for r in results) > 0.8 * wire_s
    assert min(r["tiny_s"] for r in results) > 0.020


def test_switch_port_serves_senders_round_robin_and_drops_past_its_buffer() -> None:
    port = Downlink(capacity_bytes=400)
    for name in (b"a1", b"a2", b"a3"):
        assert port.enqueue(1, name * 50)
    assert port.enqueue(2, b"b1" * 50)
    assert not port.enqueue(2, b"b2" * 50)  # 500 bytes would not fit in 400
    order = [port.next_packet()[:2] for _ in range(4)]
    assert order == [b"a1", b"b1", b"a2", b"a3"]  # b's packet does not wait behind a's
    assert port.next_packet() is None and port.queued_bytes == 0


def _ipv4_packet(destination: str, size: int) -> bytes:
    header = bytearray(20)
    header[0] = 0x45
    header[16:20] = bytes(int(x) for x in destination.split("."))
    return bytes(header) + b"\0" * (size - 20)


def test_switch_holds_packets_for_the_latency_and_serialises_at_the_rate() -> None:
    import socket

    hosts = [socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM) for _ in range(2)]
    for inner, outer in hosts:
        inner.setblocking(False)
        outer.setblocking(False)
    switch = Switch(
        [h[0].fileno() for h in hosts], ["198.18.0.1", "198.18.0.2"], latency_s=0.010, rate_bps=8e6
    )  # 1 byte per microsecond
    for _ in range(3):
        hosts[0][1].send(_ipv4_packet("198.18.0.2", 1000))
    hosts[0][1].send(_ipv4_packet("203.0.113.9", 100))  # not a host: dropped
    switch.receive(hosts[0][0].fileno(), now=0.0)
    assert switch.dropped == 1
    switch.deliver_due(0.0099)
    assert switch.forwarded == 0  # still on the wire
    arrivals = []
    for t in (0.0101, 0.0111, 0.0121, 0.0131):
        switch.deliver_due(t)
        arrivals.append(switch.forwarded)
    # arrive at 10 ms, then one 1000-byte packet per millisecond
    assert arrivals == [0, 1, 2, 3]
    assert len(hosts[1][1].recv(2000)) == 1000
    for inner, outer in hosts:
        inner.close()
        outer.close()


@needs_root
def test_a_second_up_with_the_same_tag_is_refused_and_leaves_the_first_intact() -> None:
    with EmulatedCluster(2, "10mbit", "1ms", tag="dup1") as first:
        with pytest.raises(RuntimeError, match="already up"):
            EmulatedCluster(2, "10mbit", "1ms", tag="dup1").up()
        assert {h.namespace for h in first.hosts} <= set(list_namespaces())
        assert first.forwarder_alive()
    assert not any("dup1" in n for n in list_namespaces())


def _host_groups_timings(rank: int, world_size: int, numel: int) -> dict[str, Any]:
    """All-reduce within this rank's host (ranks 2h, 2h+1) and across hosts (r, r+2)."""
    within = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    across = [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2]
    data = torch.ones(numel)
    timings = {}
    for name, group in (("within", within), ("across", across)):
        dist.all_reduce(torch.ones(1), group=group)  # connect first
        start = time.perf_counter()
        dist.all_reduce(data, group=group)
        timings[name] = time.perf_counter() - start
    env = {k: os.environ[k] for k in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")}
    return {"timings": timings, "env": env, "sum": float(data[0])}


@needs_root
def test_ranks_of_a_host_share_its_loopback_and_hosts_the_slow_link() -> None:
    with EmulatedCluster(2, "10mbit", "1ms", ranks_per_host=2) as cluster:
        assert cluster.host_env(cluster.hosts[1], 29500, {}, local_rank=1)["RANK"] == "3"
        with LocalPool(4, placement=Placement.on(cluster)) as pool:
            results = pool.run(_host_groups_timings, 1_000_000, timeout=120)
    assert [r["env"] for r in results] == [
        {"LOCAL_RANK": str(r % 2), "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": str(r // 2)}
        for r in range(4)
    ]
    assert all(r["sum"] == 4.0 for r in results)  # two all-reduces of two ranks each
    wire_s = 4e6 * 8 / 10e6  # 4 MB each way over 10 Mbit/s: 3.2 s
    for r in results:
        assert r["timings"]["across"] > 0.8 * wire_s  # the shaped link
        assert r["timings"]["within"] < 0.1 * wire_s  # the host's loopback

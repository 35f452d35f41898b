"""Faults on the emulated cluster's links: down for a while, lossy, slowed; ordered while it
runs (``thinwire cluster fault``), and what training does through them."""

from __future__ import annotations

import itertools
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import pytest

from thinwire.cluster import EmulatedCluster, check_can_emulate
from thinwire.cluster.faults import FaultError, fault_order
from thinwire.cluster.forwarder import Switch

REASON = check_can_emulate()
needs_root = pytest.mark.skipif(REASON is not None, reason=f"emulated cluster: {REASON}")


def _packet(destination: str, size: int = 100) -> bytes:
    header = bytearray(20)
    header[0] = 0x45
    header[16:20] = bytes(int(x) for x in destination.split("."))
    return bytes(header) + b"\0" * (size - 20)


@pytest.fixture
def two_hosts() -> Iterator[tuple[Switch, list[tuple[socket.socket, socket.socket]]]]:
    hosts = [socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM) for _ in range(2)]
    for inner, outer in hosts:
        inner.setblocking(False)
        outer.setblocking(False)
    fds = [h[0].fileno() for h in hosts]
    yield Switch(fds, ["198.18.0.1", "198.18.0.2"], latency_s=0.0, rate_bps=8e6), hosts
    for inner, outer in hosts:
        inner.close()
        outer.close()


def _send(switch: Switch, hosts, sender: int, destination: str, now: float) -> None:
    hosts[sender][1].send(_packet(destination))
    switch.receive(hosts[sender][0].fileno(), now)
    switch.deliver_due(now + 1.0)


def test_a_link_down_drops_both_directions_until_it_comes_back(two_hosts) -> None:
    switch, hosts = two_hosts
    assert switch.apply({"host": 1, "down_s": 5.0}, now=100.0) == "ok"
    _send(switch, hosts, 0, "198.18.0.2", now=101.0)  # to the host that is down
    _send(switch, hosts, 1, "198.18.0.1", now=104.9)  # from it
    assert (switch.forwarded, switch.dropped) == (0, 2)
    _send(switch, hosts, 0, "198.18.0.2", now=105.0)  # back up
    assert (switch.forwarded, switch.dropped) == (1, 2)


def test_loss_drops_about_its_share_and_clear_restores_the_link(two_hosts) -> None:
    switch, hosts = two_hosts
    assert switch.apply({"host": 0, "loss": 0.25}, now=0.0) == "ok"
    for i in range(400):
        _send(switch, hosts, 0, "198.18.0.2", now=float(i))
        with pytest.raises(BlockingIOError):  # drain host 1's end: one at most each time
            while True:
                hosts[1][1].recv(200)
    assert 60 <= switch.dropped <= 140, switch.dropped  # 100 expected; 4.6 sigma either way
    assert switch.apply({"host": 0, "clear": True}, now=400.0) == "ok"
    dropped = switch.dropped
    _send(switch, hosts, 0, "198.18.0.2", now=401.0)
    assert switch.dropped == dropped


def test_a_slowed_downlink_serialises_at_its_new_rate(two_hosts) -> None:
    switch, hosts = two_hosts
    assert switch.apply({"host": 1, "rate_bps": 8e5}, now=0.0) == "ok"  # 10 us a byte
    hosts[0][1].send(_packet("198.18.0.2", 1000))
    switch.receive(hosts[0][0].fileno(), 0.0)
    switch.deliver_due(0.0099)
    assert switch.forwarded == 0  # 1000 bytes take 10 ms now, 1 ms at the cluster's rate
    switch.deliver_due(0.0101)
    assert switch.forwarded == 1


def test_bad_fault_orders_say_what_to_change() -> None:
    with pytest.raises(FaultError, match="host must be an integer from 0 to 3"):
        fault_order(4, 4, down="5s")
    with pytest.raises(FaultError, match="loss must be a share of packets from 0 to 1"):
        fault_order(1, 4, loss=2.0)
    with pytest.raises(FaultError, match="order a fault"):
        fault_order(1, 4)
    with pytest.raises(FaultError, match="clear=True takes no other fault"):
        fault_order(1, 4, loss=0.1, clear=True)
    with pytest.raises(ValueError, match="duration"):
        fault_order(1, 4, down="soon")
    assert fault_order(1, 4, down="5s", rate="10mbit") == {
        "host": 1,
        "down_s": 5.0,
        "rate_bps": 10e6,
    }


PINGER = textwrap.dedent(
    """
    import socket, sys, time
    # one request a 0.1 s to the other host's echo server; print how long each took
    server, rounds = sys.argv[1], int(sys.argv[2])
    for _ in range(rounds):
        began = time.monotonic()
        with socket.create_connection((server, 7777), timeout=30) as s:
            s.sendall(b"x"); s.recv(1)
        print(f"{time.monotonic() - began:.3f}", flush=True)
        time.sleep(0.1)
    """
)

ECHO = textwrap.dedent(
    """
    import socket
    with socket.create_server(("0.0.0.0", 7777)) as server:
        while True:
            conn, _ = server.accept()
            with conn:
                conn.sendall(conn.recv(1))
    """
)


@needs_root
@pytest.mark.timeout(120)
def test_the_command_line_takes_a_link_down_and_connections_wait_for_it() -> None:
    with EmulatedCluster(2, "100mbit", "1ms", tag="fault1") as cluster:
        echo = subprocess.Popen(["ip", "netns", "exec", cluster.hosts[1].namespace,
                                 sys.executable, "-c", ECHO])  # fmt: skip
        try:
            time.sleep(1.0)
            pinger = subprocess.Popen(
                ["ip", "netns", "exec", cluster.hosts[0].namespace, sys.executable, "-c",
                 PINGER, cluster.hosts[1].address, "150"],
                stdout=subprocess.PIPE, text=True,
            )  # fmt: skip
            time.sleep(1.0)
            done = subprocess.run(
                [sys.executable, "-m", "thinwire.cli", "cluster", "fault", "--tag", "fault1",
                 "--host", "1", "--down", "2s"],
                capture_output=True, text=True, timeout=30,
            )  # fmt: skip
            assert done.returncode == 0 and "fault applied" in done.stdout, done
            bad = subprocess.run(
                [sys.executable, "-m", "thinwire.cli", "cluster", "fault", "--tag", "fault1",
                 "--host", "5", "--down", "2s"],
                capture_output=True, text=True, timeout=30,
            )  # fmt: skip
            assert bad.returncode == 2 and "host must be an integer from 0 to 1" in bad.stdout
            output, _ = pinger.communicate(timeout=90)
        finally:
            echo.kill()
            echo.wait()
    assert pinger.returncode == 0
    times = [float(t) for t in output.split()]
    assert len(times) == 150  # every request got through, the one in the outage too
    assert max(times) >= 1.0, times  # it waited for the link (TCP retransmitted)
    assert sorted(times)[len(times) // 2] < 0.5, times  # the others did not


def test_bench_faults_parse_and_are_ordered_once_at_their_step() -> None:
    from thinwire.bench.faults import FaultSchedule, parse_fault

    fault = parse_fault("1:down=2s@5", hosts=2, steps=20)
    assert (fault.host, fault.kind, fault.value, fault.step) == (1, "down", "2s", 5)
    assert parse_fault("0:loss=0.01@0", hosts=2, steps=20).order() == {"host": 0, "loss": 0.01}
    for text, says in [
        ("1:down=2s", "HOST:KIND=VALUE@STEP"),
        ("1:drop=2s@3", "HOST:KIND=VALUE@STEP"),
        ("4:down=2s@3", "host must be an integer from 0 to 1"),
        ("1:loss=lots@3", "loss must be a share"),
        ("1:loss=2@3", "loss must be a share of packets from 0 to 1"),
        ("1:rate=fast@3", "fast"),
        ("1:down=2s@20", "past the run's 20 steps"),
    ]:
        with pytest.raises(ValueError, match=None) as caught:
            parse_fault(text, hosts=2, steps=20)
        assert says in str(caught.value), (text, str(caught.value))
    orders: list[dict] = []
    schedule = FaultSchedule([fault], lambda **order: orders.append(order))
    for step in (0, 4, 5, 6, 9):
        schedule.poll(step)
    schedule.clear()
    assert orders == [{"host": 1, "down": "2s"}, {"host": 1, "clear": True}]
    assert [a["at_step"] for a in schedule.applied] == [5]


def test_bench_refuses_faults_without_the_emulated_cluster() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "thinwire.cli", "bench", "--task", "digits", "--workers", "2",
         "--steps", "4", "--methods", "dense", "--network", "loopback",
         "--fault", "1:down=1s@2"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2 and "--fault needs --network emulated" in done.stdout, done


@needs_root
@pytest.mark.timeout(300)
def test_bench_rides_through_a_link_outage_and_records_it(tmp_path) -> None:
    import json

    done = subprocess.run(
        [sys.executable, "-m", "thinwire.cli", "bench", "--task", "digits", "--workers", "2",
         "--steps", "30", "--methods", "dense", "--no-eval", "--bandwidth", "100mbit",
         "--fault", "1:down=3s@10", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (record,) = json.loads((tmp_path / "results.json").read_text())
    (applied,) = record["faults"]
    assert applied["fault"] == "1:down=3s@10" and 10 <= applied["at_step"] < 30, applied
    assert len(record["loss_history"]) == 30  # every step trained, through the outage
    times = record["time_history_s"]
    stall = max(b - a for a, b in itertools.pairwise(times))
    assert stall >= 2.5, times  # one step waited out the 3 s outage (TCP retransmits)

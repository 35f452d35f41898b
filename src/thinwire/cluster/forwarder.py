"""The emulated cluster's switch: a user-space forwarder between the hosts' TUN devices.

Every host's interface is a TUN device whose descriptor this process holds. A packet a host
sends is read here, held for the one-way ``latency`` (this kernel has no ``netem``), then
written to the destination host's descriptor no earlier than that host's downlink is free:

    arrival   = read time + latency
    start     = max(arrival, downlink_free[dst])
    delivered = start + bytes * 8 / rate            (the packet is serialised, then handed on)
    downlink_free[dst] = delivered

The uplink (host -> switch) is limited in the kernel by a ``tbf`` qdisc on each TUN device,
so a host that sends too fast is held back by its own socket buffers, as on a real NIC;
the downlink (switch -> host) is limited here, which also makes several senders to one host
share its link. Packets for unknown addresses (not IPv4, not a host) are dropped.

Run by :class:`thinwire.cluster.EmulatedCluster`, never by hand:
``python -m thinwire.cluster.forwarder CONFIG_JSON``. It creates the TUN devices, prints
``ready``, forwards until SIGTERM/SIGINT (or end of standard input, when its owner holds a
pipe to it), then removes the namespaces named in the config: the cluster is torn down
whichever process dies first.
"""

from __future__ import annotations

import contextlib
import heapq
import json
import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

from thinwire.cluster.tun import open_tun

READ_SIZE = 65_536


@dataclass
class ForwarderConfig:
    """What the forwarder needs: the TUN names and IPv4 addresses of the hosts, the link.

    ``rate_bps``: bits per second of each host's downlink (``None``: unlimited).
    ``latency_s``: one-way delay between any two hosts.
    ``namespaces``: network namespaces to delete when the forwarder exits.
    ``watch_stdin``: exit when standard input closes (the owner died or let go).
    """

    devices: list[str]
    addresses: list[str]
    latency_s: float
    rate_bps: float | None
    namespaces: list[str] = field(default_factory=list)
    watch_stdin: bool = True

    def to_json(self) -> str:
        """The config as one JSON argument."""
        return json.dumps(self.__dict__)


class Switch:
    """Moves packets between TUN descriptors with the delay and downlink rate above."""

    def __init__(
        self, fds: list[int], addresses: list[str], latency_s: float, rate_bps: float | None
    ) -> None:
        self.fds = fds
        self.routes = {
            bytes(int(x) for x in a.split(".")): fd for a, fd in zip(addresses, fds, strict=True)
        }
        self.latency_s = latency_s
        self.seconds_per_byte = 8.0 / rate_bps if rate_bps else 0.0
        self.downlink_free = dict.fromkeys(fds, 0.0)
        self.in_flight: list[tuple[float, int, int, bytes]] = []
        self.sequence = 0
        self.forwarded = 0
        self.dropped = 0

    def receive(self, fd: int, now: float) -> None:
        """Read every packet waiting on ``fd`` and schedule its delivery."""
        while True:
            try:
                packet = os.read(fd, READ_SIZE)
            except (BlockingIOError, InterruptedError):
                return
            destination = (
                self.routes.get(packet[16:20]) if packet[:1] and packet[0] >> 4 == 4 else None
            )
            if destination is None:
                self.dropped += 1
                continue
            start = max(now + self.latency_s, self.downlink_free[destination])
            delivered = start + len(packet) * self.seconds_per_byte
            self.downlink_free[destination] = delivered
            self.sequence += 1
            heapq.heappush(self.in_flight, (delivered, self.sequence, destination, packet))

    def deliver_due(self, now: float) -> None:
        """Write every packet whose delivery time has come to its destination."""
        while self.in_flight and self.in_flight[0][0] <= now:
            _, _, destination, packet = heapq.heappop(self.in_flight)
            try:
                os.write(destination, packet)
                self.forwarded += 1
            except OSError:  # the host's interface is down or gone: the packet is lost
                self.dropped += 1

    def next_due(self, now: float) -> float | None:
        """Seconds until the next delivery, or ``None`` when nothing is in flight."""
        return max(0.0, self.in_flight[0][0] - now) if self.in_flight else None


def serve(config: ForwarderConfig) -> None:
    """Create the devices, announce ``ready``, forward until told to stop, clean up."""
    stopping = False

    def stop(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    fds: list[int] = []
    try:
        for name in config.devices:
            fds.append(open_tun(name))
        with contextlib.suppress(OSError):
            os.nice(-10)  # packets must flow while the training processes use every core
        switch = Switch(fds, config.addresses, config.latency_s, config.rate_bps)
        poller = select.epoll()
        for fd in fds:
            poller.register(fd, select.EPOLLIN)
        stdin = sys.stdin.fileno()
        if config.watch_stdin:
            poller.register(stdin, select.EPOLLIN | select.EPOLLHUP)
        print("ready", flush=True)
        while not stopping:
            wait = switch.next_due(time.monotonic())
            try:
                events = poller.poll(0.5 if wait is None else min(wait, 0.5))
            except InterruptedError:
                continue
            now = time.monotonic()
            for fd, _ in events:
                if fd == stdin:
                    if not os.read(stdin, 4096):
                        stopping = True
                    continue
                switch.receive(fd, now)
            switch.deliver_due(time.monotonic())
    finally:
        for fd in fds:
            os.close(fd)
        for namespace in config.namespaces:
            subprocess.run(["ip", "netns", "delete", namespace], capture_output=True, check=False)


def main() -> None:
    """Entry point: ``python -m thinwire.cluster.forwarder CONFIG_JSON``."""
    config = ForwarderConfig(**json.loads(sys.argv[1]))
    serve(config)


if __name__ == "__main__":
    main()

"""The emulated cluster's switch: a user-space forwarder between the hosts' TUN devices.

Every host's interface is a TUN device whose descriptor this process holds. A packet a host
sends is read here, held for the one-way ``latency`` (this kernel has no ``netem``), then
queued at the destination's switch port and serialised onto its downlink at the link rate:

    arrival   = read time + latency                 (propagation)
    queue       one FIFO per sending host, served round-robin; drop-tail past the buffer
    delivered = start of service + bytes * 8 / rate (the packet is serialised, handed on)

The uplink (host -> switch) is limited in the kernel by a ``tbf`` qdisc with a short queue
on each TUN device, so a host that sends too fast is held back by its own socket buffers,
as on a real NIC; the downlink (switch -> host) is limited here, which also makes several
senders to one host share its link fairly. Per-sender queues matter: in a ring every host
receives bulk data from one neighbour and acknowledgements from the other, and with one
FIFO the acknowledgements (and gloo's small ready messages) would wait behind the bulk
data, slowing every ring step. Packets for unknown addresses (not IPv4, not a host) are
dropped.

Faults (``thinwire cluster fault``, :meth:`EmulatedCluster.fault`) arrive as JSON datagrams
on a Unix socket (``control_path``): a host's link down for some seconds (every packet it
sends or that is sent to it is dropped), a packet loss rate on its link, or another rate
for its downlink; each is answered with ``ok`` or the reason it was refused.

Run by :class:`thinwire.cluster.EmulatedCluster`, never by hand:
``python -m thinwire.cluster.forwarder CONFIG_JSON``. It creates the TUN devices, prints
``ready``, forwards until SIGTERM/SIGINT (or end of standard input, when its owner holds a
pipe to it), then removes the namespaces named in the config: the cluster is torn down
whichever process dies first.
"""

from __future__ import annotations

import collections
import contextlib
import heapq
import json
import os
import random
import select
import signal
import socket
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
    ``buffer_bytes``: each switch port's buffer; packets beyond it are dropped.
    ``control_path``: the Unix datagram socket that takes faults (``None``: no faults).
    """

    devices: list[str]
    addresses: list[str]
    latency_s: float
    rate_bps: float | None
    namespaces: list[str] = field(default_factory=list)
    watch_stdin: bool = True
    buffer_bytes: int = 256 * 1024
    control_path: str | None = None

    def to_json(self) -> str:
        """The config as one JSON argument."""
        return json.dumps(self.__dict__)


@dataclass
class LinkFault:
    """What is wrong with one host's link: down until a time (monotonic seconds), a share
    of its packets lost, another downlink rate (``None``: the cluster's)."""

    down_until: float = 0.0
    loss: float = 0.0
    rate_bps: float | None = None


class Downlink:
    """One host's port on the switch: a FIFO per sending host, served round-robin one
    packet at a time (so a host's acknowledgements do not wait behind another host's bulk
    data), and a byte budget beyond which arriving packets are dropped (drop-tail)."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.queues: dict[int, collections.deque[bytes]] = {}
        self.turns: collections.deque[int] = collections.deque()  # senders waiting, in order
        self.queued_bytes = 0
        self.busy = False

    def enqueue(self, sender: int, packet: bytes) -> bool:
        """Queue ``packet`` from ``sender``; ``False`` (dropped) if the buffer is full."""
        if self.queued_bytes + len(packet) > self.capacity_bytes:
            return False
        queue = self.queues.setdefault(sender, collections.deque())
        if not queue:
            self.turns.append(sender)
        queue.append(packet)
        self.queued_bytes += len(packet)
        return True

    def next_packet(self) -> bytes | None:
        """The next packet to serialise (round-robin over senders), or ``None``."""
        if not self.turns:
            return None
        sender = self.turns.popleft()
        queue = self.queues[sender]
        packet = queue.popleft()
        self.queued_bytes -= len(packet)
        if queue:
            self.turns.append(sender)
        return packet


class Switch:
    """Moves packets between TUN descriptors with the delay and downlink rate above.

    Events, in time order: ``ARRIVE`` (a packet reaches the destination's port after the
    latency: queue it), ``SENT`` (the port finished serialising a packet: hand it to the
    host, start the next). Times are virtual, so pacing does not drift with wake-ups.
    """

    ARRIVE, SENT = 0, 1

    def __init__(
        self,
        fds: list[int],
        addresses: list[str],
        latency_s: float,
        rate_bps: float | None,
        buffer_bytes: int = 256 * 1024,
    ) -> None:
        self.routes = {
            bytes(int(x) for x in a.split(".")): fd for a, fd in zip(addresses, fds, strict=True)
        }
        self.latency_s = latency_s
        self.seconds_per_byte = 8.0 / rate_bps if rate_bps else 0.0
        self.ports = {fd: Downlink(buffer_bytes) for fd in fds}
        self.fds = list(fds)
        self.faults: dict[int, LinkFault] = {}
        self.chance = random.Random(0)
        self.events: list[tuple[float, int, int, int, int, bytes]] = []
        self.sequence = 0
        self.forwarded = 0
        self.dropped = 0

    def _push(self, when: float, kind: int, destination: int, sender: int, packet: bytes) -> None:
        self.sequence += 1
        heapq.heappush(self.events, (when, self.sequence, kind, destination, sender, packet))

    def receive(self, fd: int, now: float) -> None:
        """Read every packet waiting on ``fd`` and schedule its arrival at the switch port."""
        while True:
            try:
                packet = os.read(fd, READ_SIZE)
            except (BlockingIOError, InterruptedError):
                return
            destination = (
                self.routes.get(packet[16:20]) if packet[:1] and packet[0] >> 4 == 4 else None
            )
            if destination is None or self._lost(fd, now) or self._lost(destination, now):
                self.dropped += 1
                continue
            self._push(now + self.latency_s, self.ARRIVE, destination, fd, packet)

    def _lost(self, fd: int, now: float) -> bool:
        """Whether a packet from or to ``fd``'s host is lost now (its link down, or its
        loss rate drawn)."""
        fault = self.faults.get(fd)
        if fault is None:
            return False
        return now < fault.down_until or (fault.loss > 0 and self.chance.random() < fault.loss)

    def _seconds_per_byte(self, fd: int) -> float:
        fault = self.faults.get(fd)
        if fault is not None and fault.rate_bps is not None:
            return 8.0 / fault.rate_bps
        return self.seconds_per_byte

    def apply(self, order: dict, now: float) -> str:
        """Apply one fault order (``{"host": i, "down_s": .., "loss": .., "rate_bps": ..}``
        or ``{"host": i, "clear": true}``); ``"ok"`` or why it was refused."""
        host = order.get("host")
        if not isinstance(host, int) or not 0 <= host < len(self.fds):
            return f"error: host must be 0 to {len(self.fds) - 1}, got {host!r}"
        fd = self.fds[host]
        if order.get("clear"):
            self.faults.pop(fd, None)
            return "ok"
        fault = self.faults.setdefault(fd, LinkFault())
        if order.get("down_s") is not None:
            fault.down_until = now + float(order["down_s"])
        if order.get("loss") is not None:
            fault.loss = float(order["loss"])
        if order.get("rate_bps") is not None:
            fault.rate_bps = float(order["rate_bps"])
        return "ok"

    def deliver_due(self, now: float) -> None:
        """Process every event whose time has come."""
        while self.events and self.events[0][0] <= now:
            when, _, kind, destination, sender, packet = heapq.heappop(self.events)
            port = self.ports[destination]
            if kind == self.ARRIVE:
                if not self._seconds_per_byte(destination):
                    self._write(destination, packet)
                elif not port.enqueue(sender, packet):
                    self.dropped += 1
                elif not port.busy:
                    self._start(destination, when)
            else:
                self._write(destination, packet)
                port.busy = False
                self._start(destination, when)

    def _start(self, destination: int, when: float) -> None:
        port = self.ports[destination]
        packet = port.next_packet()
        if packet is not None:
            port.busy = True
            done = when + len(packet) * self._seconds_per_byte(destination)
            self._push(done, self.SENT, destination, 0, packet)

    def _write(self, destination: int, packet: bytes) -> None:
        try:
            os.write(destination, packet)
            self.forwarded += 1
        except OSError:  # the host's interface is down or gone: the packet is lost
            self.dropped += 1

    def next_due(self, now: float) -> float | None:
        """Seconds until the next event, or ``None`` when nothing is in flight."""
        return max(0.0, self.events[0][0] - now) if self.events else None


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
        switch = Switch(
            fds, config.addresses, config.latency_s, config.rate_bps, config.buffer_bytes
        )
        poller = select.epoll()
        for fd in fds:
            poller.register(fd, select.EPOLLIN)
        stdin = sys.stdin.fileno()
        if config.watch_stdin:
            poller.register(stdin, select.EPOLLIN | select.EPOLLHUP)
        control = _control_socket(config.control_path)
        if control is not None:
            poller.register(control.fileno(), select.EPOLLIN)
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
                if control is not None and fd == control.fileno():
                    _answer(control, switch, now)
                    continue
                switch.receive(fd, now)
            switch.deliver_due(time.monotonic())
    finally:
        if config.control_path is not None:
            with contextlib.suppress(OSError):
                os.unlink(config.control_path)
        for fd in fds:
            os.close(fd)
        for namespace in config.namespaces:
            subprocess.run(["ip", "netns", "delete", namespace], capture_output=True, check=False)


def _control_socket(path: str | None) -> socket.socket | None:
    if path is None:
        return None
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    control = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    control.bind(path)
    control.setblocking(False)
    return control


def _answer(control: socket.socket, switch: Switch, now: float) -> None:
    """Apply each fault order waiting on ``control`` and answer its sender."""
    while True:
        try:
            data, sender = control.recvfrom(4096)
        except (BlockingIOError, InterruptedError):
            return
        try:
            answer = switch.apply(json.loads(data), now)
        except (ValueError, TypeError) as error:
            answer = f"error: {error}"
        print(f"{time.time():.3f} fault {data.decode(errors='replace')}: {answer}", file=sys.stderr)
        if sender:
            with contextlib.suppress(OSError):
                control.sendto(answer.encode(), sender)


def main() -> None:
    """Entry point: ``python -m thinwire.cluster.forwarder CONFIG_JSON``."""
    config = ForwarderConfig(**json.loads(sys.argv[1]))
    serve(config)


if __name__ == "__main__":
    main()

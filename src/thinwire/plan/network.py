"""The network of the cost model: a worker's link and what one collective costs on it.

Pure functions over numbers (no torch, no ``torch.distributed``): :class:`Link` is the
network, :class:`Collective` one collective a rank issues, :func:`collective_time` its
seconds and :func:`wire_bytes` its bytes on the wire; :mod:`thinwire.plan.cost` builds a
step's timeline from them. :func:`format_rate` and :func:`format_bytes` print bandwidths
and sizes.

**Collectives (alpha-beta, ring algorithms as gloo and NCCL run them).** With N ranks, a
message of ``S`` bytes per rank, bandwidth ``B`` and a per-step latency ``alpha``::

    all-reduce  (reduce-scatter + all-gather):  2 (N-1) alpha  +  2 (N-1)/N * S * o / B
    all-gather:                                   (N-1) alpha  +    (N-1)   * S * o / B
    direct (all-to-all of each rank's payload):         alpha  +    (N-1)   * S * o / B
    all-to-all (S in all, a part for each peer):        alpha  +              S * o / B
    broadcast from rank 0 (gloo):                       alpha  +    (N-1)   * S * o / B

``o`` is the TCP/IPv4 header overhead: every ``mtu``-byte packet carries ``mtu - 52``
payload bytes (20 IP + 20 TCP + 12 timestamp option), as ``tc`` and the emulated cluster
count bytes. The all-reduce's bandwidth term is nearly independent of N; the all-gather's
grows linearly with N (every rank receives every other rank's payload).

One ring step's latency is ``alpha = 2 L + mtu * 8 / B`` for one-way latency ``L``: gloo's
TCP transport sends a buffer only after the receiver has announced the matching receive
(a round trip, not one way), and the switch stores and forwards each packet (one more
packet of serialisation per step). Measured on the emulated 4-host cluster (10 and 100
Mbit/s, 1 and 5 ms, 1 kB to 1 MB) this form is within about 10 % of gloo's all-reduce and
all-gather; the textbook ``alpha = L`` is ``Link(..., step_delays=1, store_and_forward=False)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from thinwire.comm.paced import window_of

#: bytes of headers in every TCP/IPv4 packet: 20 IP + 20 TCP + 12 (timestamp option)
TCP_IP_HEADER_BYTES = 52
#: a standard Ethernet MTU; the emulated cluster raises it with the rate (see Link.mtu)
ETHERNET_MTU = 1500
#: one-way latencies per ring step: gloo waits for the receiver's "ready" message first
GLOO_STEP_DELAYS = 2.0

ALLREDUCE = "allreduce"
ALLGATHER = "allgather"
DIRECT = "direct"
ALLTOALL = "alltoall"  #: ``all_to_all_single``: ``nbytes`` is what a rank sends to all peers
#: the scatter rounds' all-to-all, in windows of partners (:mod:`thinwire.comm.paced`)
PACED = "paced"
KINDS = (ALLREDUCE, ALLGATHER, DIRECT, ALLTOALL, PACED)


@dataclass(frozen=True)
class Link:
    """A worker's network link and how a ring step uses it.

    Options:
        bandwidth_bps: bits per second in each direction (full duplex).
        latency_s: one-way latency between two workers.
        mtu: IP packet size in bytes (the emulated cluster's ``EmulatedCluster.mtu``).
        header_bytes: TCP/IP headers per packet (0: count payload only).
        step_delays: one-way latencies per ring step (gloo: 2, see the module docstring).
        store_and_forward: add one packet's serialisation per step (a switch in between).
    """

    bandwidth_bps: float
    latency_s: float = 0.0
    mtu: int = ETHERNET_MTU
    header_bytes: int = TCP_IP_HEADER_BYTES
    step_delays: float = GLOO_STEP_DELAYS
    store_and_forward: bool = True

    def __post_init__(self) -> None:
        if not (isinstance(self.bandwidth_bps, (int, float)) and self.bandwidth_bps > 0):
            raise ValueError(f"bandwidth must be > 0 bits/s, got {self.bandwidth_bps!r}")
        if not math.isfinite(self.bandwidth_bps):
            raise ValueError(f"bandwidth must be finite, got {self.bandwidth_bps!r}")
        if not (isinstance(self.latency_s, (int, float)) and 0 <= self.latency_s < math.inf):
            raise ValueError(f"latency must be >= 0 s and finite, got {self.latency_s!r}")
        if self.header_bytes < 0 or self.mtu <= self.header_bytes:
            raise ValueError(
                f"mtu must exceed header_bytes >= 0, got mtu={self.mtu}, "
                f"header_bytes={self.header_bytes}"
            )
        if not self.step_delays >= 0:
            raise ValueError(f"step_delays must be >= 0, got {self.step_delays!r}")

    @property
    def step_latency_s(self) -> float:
        """Alpha: the latency of one ring step, ``step_delays * L`` (+ one packet's
        serialisation if ``store_and_forward``)."""
        forward = self.mtu * 8.0 / self.bandwidth_bps if self.store_and_forward else 0.0
        return self.step_delays * self.latency_s + forward

    @property
    def overhead(self) -> float:
        """Bytes on the wire per payload byte: ``mtu / (mtu - header_bytes)``."""
        return self.mtu / (self.mtu - self.header_bytes)

    def seconds_per_byte(self) -> float:
        """Time to push one payload byte through the link (beta)."""
        return 8.0 * self.overhead / self.bandwidth_bps

    def with_bandwidth(self, bandwidth_bps: float) -> Link:
        """The same link at another bandwidth."""
        return replace(self, bandwidth_bps=bandwidth_bps)


@dataclass(frozen=True)
class Collective:
    """One collective a rank issues: ``kind`` (``"allreduce"``, ``"allgather"`` or
    ``"direct"``) over ``nbytes`` bytes of its own payload."""

    kind: str
    nbytes: int

    def __post_init__(self) -> None:
        _check_kind(self.kind)
        if self.nbytes < 0:
            raise ValueError(f"a collective cannot carry {self.nbytes} bytes")


def collective_time(kind: str, nbytes: float, world_size: int, link: Link) -> float:
    """Seconds one collective of ``nbytes`` per rank takes over ``world_size`` ranks.

    All-reduce: ``2(N-1)`` ring steps and ``2(N-1)/N * nbytes`` per rank on the wire;
    all-gather: ``N-1`` ring steps and ``(N-1) * nbytes``; direct: one step and
    ``(N-1) * nbytes``; all-to-all: one step and ``nbytes`` (split among the peers); paced
    all-to-all: the same bytes, a step per window of partners (:func:`paced_steps`); each
    step costs ``link.step_latency_s``. One rank (or nothing to send) costs nothing.
    """
    _check_kind(kind)
    check_world(world_size)
    if nbytes < 0:
        raise ValueError(f"a collective cannot carry {nbytes} bytes")
    if world_size == 1 or nbytes == 0:
        return 0.0
    steps = {ALLREDUCE: 2 * (world_size - 1), ALLGATHER: world_size - 1}.get(kind, 1)
    if kind == PACED:
        steps = paced_steps(nbytes, world_size)
    volume = wire_bytes(kind, nbytes, world_size)
    return steps * link.step_latency_s + volume * link.seconds_per_byte()


def broadcast_time(nbytes: float, world_size: int, link: Link) -> float:
    """Seconds a broadcast of ``nbytes`` from one rank to the ``world_size - 1`` others
    takes as gloo does it: the root sends every copy over its own link, so it costs what a
    ``direct`` round of the same payload costs (one step latency, ``N - 1`` copies)."""
    if nbytes < 0:
        raise ValueError(f"a broadcast cannot carry {nbytes} bytes")
    return collective_time(DIRECT, nbytes, world_size, link)


def wire_bytes(kind: str, nbytes: float, world_size: int) -> float:
    """Payload bytes one rank sends (and receives) in a collective of ``nbytes``."""
    _check_kind(kind)
    check_world(world_size)
    if kind == ALLREDUCE:
        return 2 * (world_size - 1) * nbytes / world_size
    if kind in (ALLTOALL, PACED):
        return nbytes
    return (world_size - 1) * nbytes


def paced_steps(nbytes: float, world_size: int, budget: int | None = None) -> int:
    """Windows of partners a paced all-to-all of ``nbytes`` a rank (split evenly among the
    peers) takes: ``ceil((N - 1) / window)``, the window as
    :func:`thinwire.comm.paced.window_of` sizes it for ``budget`` (default: the
    transport's, :data:`thinwire.comm.paced.PACE_BYTES`)."""
    peers = world_size - 1
    if peers < 1:
        return 1
    per_peer = math.ceil(nbytes / peers)
    window = window_of([0] + [per_peer] * peers, rank=0, budget=budget)
    return math.ceil(peers / window)


def format_rate(bits_per_second: float) -> str:
    """``1.5e8`` -> ``"150 Mbit/s"``."""
    for unit, scale in (("Tbit/s", 1e12), ("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits_per_second >= scale:
            return f"{bits_per_second / scale:.3g} {unit}"
    return f"{bits_per_second:.3g} bit/s"


def format_bytes(nbytes: float) -> str:
    """``2.5e6`` -> ``"2.5 MB"`` (decimal units, as bandwidths are)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes:.0f} B"


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown collective kind {kind!r}; choose one of: {', '.join(KINDS)}")


def check_world(world_size: int) -> None:
    """Refuse a world size that is not an integer >= 1 (``ValueError``)."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world size (workers) must be an integer >= 1, got {world_size!r}")


__all__ = [
    "ALLGATHER",
    "ALLREDUCE",
    "ALLTOALL",
    "DIRECT",
    "ETHERNET_MTU",
    "GLOO_STEP_DELAYS",
    "KINDS",
    "TCP_IP_HEADER_BYTES",
    "Collective",
    "Link",
    "broadcast_time",
    "check_world",
    "collective_time",
    "format_bytes",
    "format_rate",
    "wire_bytes",
]

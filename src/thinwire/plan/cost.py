"""The cost model of one data-parallel step: a bucket timeline over alpha-beta collectives.

Pure functions over numbers (no torch, no ``torch.distributed``): what a step sends is
described by :class:`MethodCost` (per gradient bucket: when it is ready, how long its
compression takes, which collectives it issues and how many bytes each carries), what it
computes by :class:`ComputeTime`, the network by :class:`Link` (:mod:`thinwire.plan.network`
holds it and the alpha-beta time of each collective). :func:`step_time` and
:func:`predict_step` give one step under a method's schedule; :mod:`thinwire.plan.breakeven`
compares methods across bandwidths with them.

**Step timeline (overlap assumption).** One CPU core per worker; the network is a second,
independent resource::

    forward | backward ............................ | optimizer
              bucket b ready at  r_b of the backward pass (measured per parameter)
              exchange job b  =  compress_b (CPU)  then  its collectives (network)

Exchange jobs run one after another in bucket order (DDP's reducer and thinwire's exchange
thread both keep that order); job b starts once bucket b is ready and job b-1 is done.
Compression is CPU work on the core that runs the backward pass, so it delays the backward
pass by its own duration: *compression never hides behind compute, network time does*.
The optimizer step starts when both the (delayed) backward pass and the last collective
have finished::

    step = max(forward + backward + compress_total,  end of the last collective) + optimizer

A sharded embedding table fetches the rows a batch looks up during the forward pass, which
waits for them: ``forward_collectives`` lengthen the forward pass; its row gradients are a
bucket ready when the table's gradient is, exchanged after DDP's buckets (in the bench
they travel on a process group of their own, beside DDP's: the model queues them, an
overestimate when both are large); the next batch's routing, prefetched on a thread of
its own, is ``background_collectives``, counted in the bytes but not on the critical path
(:mod:`thinwire.plan.embedding`).

DDP with ``broadcast_buffers`` (its default) first broadcasts rank 0's buffers (batch-norm
statistics, ``broadcast_bytes``) at the start of every forward pass, which waits for it:
the whole timeline above starts that much later. gloo's broadcast sends the whole payload
from the root to every other rank over the root's link: on the emulated cluster (4 hosts,
10 Mbit/s) 1 MB took 2.31 and 2.55 s in two runs, about three times one transfer (a
binomial tree would take two), and the ResNet task's 19 kB 54-60 ms (each with a
one-element all-reduce after it); the model gives 2.49 s and 51 ms.

With ``overlap=False`` (an optimizer wrapper that exchanges after ``backward()``) every
bucket is ready at the end of the backward pass. Scaling efficiency is
``compute / step``: 1.0 when all communication hides behind the backward pass.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from thinwire.plan.network import (
    Collective,
    Link,
    broadcast_time,
    check_world,
    collective_time,
    wire_bytes,
)
from thinwire.plan.topology import Topology


@dataclass(frozen=True)
class BucketCost:
    """One gradient bucket of a step: ``ready`` is the fraction of the backward pass after
    which its gradients exist (0..1), ``compress_s`` the CPU time of its compression and
    decompression, ``collectives`` what it sends, in order."""

    ready: float
    compress_s: float
    collectives: tuple[Collective, ...]
    numel: int = 0
    #: how many of ``collectives`` each round of the bucket's protocol issues, in order
    #: (empty: one a round); :mod:`thinwire.plan.stage_buckets` fuses rounds by it
    rounds: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not 0.0 <= self.ready <= 1.0:
            raise ValueError(f"bucket ready fraction must be in [0, 1], got {self.ready}")
        if self.compress_s < 0:
            raise ValueError(f"compress time must be >= 0, got {self.compress_s}")
        if self.rounds and sum(self.rounds) != len(self.collectives):
            raise ValueError(
                f"rounds {self.rounds} issue {sum(self.rounds)} collectives, the bucket "
                f"has {len(self.collectives)}"
            )

    def comm_time(self, world_size: int, link: Link) -> float:
        """Seconds of this bucket's collectives, one after another."""
        return sum(collective_time(c.kind, c.nbytes, world_size, link) for c in self.collectives)


@dataclass(frozen=True)
class MethodCost:
    """What one method sends per optimizer step, bucket by bucket in exchange order.

    ``dense_bytes`` is the fp32 size of all gradients (for the compression ratio). A method
    without buckets (``local``) does not communicate at all.
    """

    method: str
    buckets: tuple[BucketCost, ...] = ()
    dense_bytes: int = 0
    options: Mapping[str, object] = field(default_factory=dict)
    #: how the step is scheduled: ``"ddp"`` (buckets overlap the backward pass), ``"dga"``,
    #: ``"ps-sync"`` or ``"ps-async"`` (see :func:`step_time`); ``options`` holds their
    #: ``delay``, ``lanes`` and ``servers``
    schedule: str = "ddp"
    #: bytes DDP broadcasts from rank 0 before every forward pass (its buffers; 0: none)
    broadcast_bytes: int = 0
    #: collectives the forward pass waits for (a sharded embedding table's row lookups)
    forward_collectives: tuple[Collective, ...] = ()
    #: collectives that run beside the step, off its critical path (prefetched routing)
    background_collectives: tuple[Collective, ...] = ()

    def _all_collectives(self) -> list[Collective]:
        return [
            *self.forward_collectives,
            *self.background_collectives,
            *(c for b in self.buckets for c in b.collectives),
        ]

    @property
    def payload_bytes(self) -> int:
        """Bytes this rank contributes to collectives per step."""
        return sum(c.nbytes for c in self._all_collectives())

    @property
    def collectives(self) -> int:
        """Collectives per step (the buffer broadcast counts as one)."""
        return len(self._all_collectives()) + (self.broadcast_bytes > 0)

    @property
    def compress_s(self) -> float:
        """CPU seconds of compression and decompression per step."""
        return sum(b.compress_s for b in self.buckets)

    @property
    def compression_ratio(self) -> float:
        """Dense fp32 bytes over payload bytes (``nan`` without communication)."""
        return self.dense_bytes / self.payload_bytes if self.payload_bytes else math.nan

    def sent_bytes(self, world_size: int) -> float:
        """Payload bytes one rank sends per step under the ring algorithms (the buffer
        broadcast's N - 1 messages averaged over the N ranks)."""
        broadcast = (world_size - 1) / world_size * self.broadcast_bytes
        return broadcast + sum(
            wire_bytes(c.kind, c.nbytes, world_size) for c in self._all_collectives()
        )

    def comm_time(self, world_size: int, link: Link) -> float:
        """Seconds of all collectives of a step, back to back (nothing overlapped)."""
        return broadcast_time(self.broadcast_bytes, world_size, link) + sum(
            collective_time(c.kind, c.nbytes, world_size, link) for c in self._all_collectives()
        )

    def forward_comm_time(self, world_size: int, link: Link) -> float:
        """Seconds the forward pass waits for its own collectives (table lookups)."""
        return sum(
            collective_time(c.kind, c.nbytes, world_size, link) for c in self.forward_collectives
        )

    def scaled(self, compress_factor: float) -> MethodCost:
        """The same traffic with compression times multiplied by ``compress_factor`` (e.g.
        the slowdown of CPUs shared by several workers)."""
        _check_factor(compress_factor)
        buckets = tuple(replace(b, compress_s=b.compress_s * compress_factor) for b in self.buckets)
        return replace(self, buckets=buckets)


@dataclass(frozen=True)
class ComputeTime:
    """Seconds of one worker's forward pass, backward pass and optimizer step."""

    forward_s: float
    backward_s: float
    optimizer_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("forward_s", "backward_s", "optimizer_s"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a finite time >= 0, got {value!r}")

    @property
    def total(self) -> float:
        """The compute-only step time (``local``: nothing exchanged)."""
        return self.forward_s + self.backward_s + self.optimizer_s

    def scaled(self, factor: float) -> ComputeTime:
        """Every phase multiplied by ``factor``: e.g. ``measured_local_step / total`` to
        calibrate a one-process profile to workers that share CPUs."""
        _check_factor(factor)
        return ComputeTime(
            self.forward_s * factor, self.backward_s * factor, self.optimizer_s * factor
        )


@dataclass(frozen=True)
class StepPrediction:
    """The predicted step of one method on one link and world size (seconds, bytes)."""

    method: str
    world_size: int
    bandwidth_bps: float
    latency_s: float
    step_s: float
    compute_s: float
    compress_s: float
    comm_s: float
    exposed_comm_s: float
    payload_bytes: int
    sent_bytes: float
    collectives: int
    compression_ratio: float

    @property
    def efficiency(self) -> float:
        """Scaling efficiency: the compute-only step over the predicted step."""
        return self.compute_s / self.step_s if self.step_s > 0 else 1.0

    def as_dict(self) -> dict[str, float | int | str]:
        """A flat dict for JSON."""
        return {
            "method": self.method,
            "world_size": self.world_size,
            "bandwidth_bps": self.bandwidth_bps,
            "latency_s": self.latency_s,
            "step_s": self.step_s,
            "compute_s": self.compute_s,
            "compress_s": self.compress_s,
            "comm_s": self.comm_s,
            "exposed_comm_s": self.exposed_comm_s,
            "efficiency": self.efficiency,
            "payload_bytes": self.payload_bytes,
            "sent_bytes": self.sent_bytes,
            "collectives": self.collectives,
            "compression_ratio": self.compression_ratio,
        }


def step_time(
    compute: ComputeTime,
    cost: MethodCost,
    link: Link,
    world_size: int,
    *,
    overlap: bool = True,
) -> float:
    """Seconds of one step under the timeline of the module docstring, or of the
    method's own schedule (:func:`delayed_step_time`, :func:`server_step_time`)."""
    check_world(world_size)
    if cost.schedule == "dga":
        return delayed_step_time(compute, cost, link, world_size)
    if cost.schedule in ("ps-sync", "ps-async"):
        return server_step_time(compute, cost, link, world_size)
    if cost.schedule == "local":
        return local_step_time(compute, cost, link, world_size)
    forward_end = (
        broadcast_time(cost.broadcast_bytes, world_size, link)
        + compute.forward_s
        + cost.forward_comm_time(world_size, link)
    )
    backward_end = forward_end + compute.backward_s
    cpu_delay = 0.0  # compression done so far, which has pushed the backward pass back
    exchange_free = 0.0  # when the exchange thread (and the link) can take the next job
    for bucket in cost.buckets:
        ready = forward_end + compute.backward_s * (bucket.ready if overlap else 1.0)
        start = max(ready + cpu_delay, exchange_free)
        cpu_delay += bucket.compress_s
        exchange_free = start + bucket.compress_s + bucket.comm_time(world_size, link)
    return max(backward_end + cpu_delay, exchange_free) + compute.optimizer_s


def group_step_time(
    compute: ComputeTime,
    cost: MethodCost,
    topology: Topology,
    ranks: Sequence[int] | None = None,
    *,
    sharing: int = 1,
    overlap: bool = True,
) -> float:
    """:func:`step_time` of a data-parallel group on ``topology``: the group ``ranks``
    (default: every rank) exchanges over the link it spans (the network, shared by
    ``sharing`` groups crossing it at once, if its ranks are on several hosts; else the
    hosts' own link). A hybrid plan's ``"dp"`` groups are such groups."""
    group = list(range(topology.world_size)) if ranks is None else list(ranks)
    link = topology.link_of(group, sharing)
    return step_time(compute, cost, link, len(group), overlap=overlap)


def delayed_step_time(compute: ComputeTime, cost: MethodCost, link: Link, world_size: int) -> float:
    """Delayed gradient averaging in its steady state: an exchange starts after each step
    and has ``delay`` steps to finish; ``lanes`` of them may be in flight at once::

        D = 0:  compute + compress + exchange                  (nothing overlaps)
        D > 0:  max(compute + compress,  exchange / min(lanes, D),  wire bytes / B)

    Latency is what concurrent exchanges hide; the link's bandwidth they share."""
    delay = int(cost.options.get("delay", 1))  # type: ignore[call-overload]
    lanes = int(cost.options.get("lanes", 1))  # type: ignore[call-overload]
    cpu = compute.total + cost.compress_s
    exchange = cost.comm_time(world_size, link)
    if delay == 0:
        return cpu + exchange
    volume = cost.sent_bytes(world_size) * link.seconds_per_byte()
    return max(cpu, exchange / min(lanes, delay), volume)


def local_step_time(compute: ComputeTime, cost: MethodCost, link: Link, world_size: int) -> float:
    """Local SGD and DiLoCo, per inner step: ``sync_every`` (H) steps alone, then each of
    ``fragments`` (F) parts of the model exchanged once per round (``cost`` is one
    exchange of the whole model), in the background over ``overlap`` (T) inner steps::

        T = 0:  compute + (compress + F * fragment) / H        (each exchange stops training)
        T > 0:  max(compute + (compress + F * max(0, fragment - T * compute)) / H,
                    wire bytes / B / H)

    ``fragment`` is one fragment's exchange: 1/F of the bytes, all of the latency. It
    hides behind the T inner steps that run while it travels; what does not fit in them
    waits, once per fragment and round."""
    exposed = round_exchange_s(cost, link, world_size, compute.total)
    rounds = int(cost.options.get("sync_every", 1))  # type: ignore[call-overload]
    volume = cost.sent_bytes(world_size) * link.seconds_per_byte() / rounds
    overlap = int(cost.options.get("overlap", 0))  # type: ignore[call-overload]
    return max(compute.total + exposed, volume if overlap else 0.0)


def round_exchange_s(cost: MethodCost, link: Link, world_size: int, step_s: float) -> float:
    """The seconds per inner step that the rounds of ``cost`` (schedule ``"local"``) add
    to steps of ``step_s`` (see :func:`local_step_time`): compression and the part of each
    fragment's exchange that its ``overlap`` steps do not hide, over ``sync_every`` steps."""
    rounds = int(cost.options.get("sync_every", 1))  # type: ignore[call-overload]
    parts = int(cost.options.get("fragments", 1))  # type: ignore[call-overload]
    overlap = int(cost.options.get("overlap", 0))  # type: ignore[call-overload]
    fragment = sum(  # one fragment's exchange: its share of the bytes, every latency
        collective_time(c.kind, c.nbytes / parts, world_size, link)
        for bucket in cost.buckets
        for c in bucket.collectives
    )
    return (cost.compress_s + parts * max(0.0, fragment - overlap * step_s)) / rounds


def server_step_time(compute: ComputeTime, cost: MethodCost, link: Link, world_size: int) -> float:
    """A parameter server with ``servers`` shards on worker ranks (colocated). A worker
    pushes its payload (``push`` bytes, all shards together) and pulls the fp32
    parameters (``pull``); each message waits one ``alpha`` (gloo's rendezvous). A shard's
    link takes the other workers' pushes in and sends their pulls out::

        server_in  = (N - 1) * push / servers      server_out = (N - 1) * pull / servers
        ps-sync:   compute + compress + 2 alpha + (max(server_in, push)
                                                   + max(server_out, pull)) / B
        ps-async:  max(compute + compress + 2 alpha + (push + pull) / B,
                       server_in / B,  server_out / B)

    Synchronous steps add the push and the pull to the compute; asynchronous workers
    only queue behind each other on a shard's link."""
    servers = int(cost.options.get("servers", 1))  # type: ignore[call-overload]
    push, pull = cost.payload_bytes, cost.dense_bytes
    if world_size == 1:
        return compute.total + cost.compress_s
    per_byte, alpha = link.seconds_per_byte(), link.step_latency_s
    server_in = (world_size - 1) * push / servers
    server_out = (world_size - 1) * pull / servers
    cpu = compute.total + cost.compress_s
    if cost.schedule == "ps-sync":
        return cpu + 2 * alpha + (max(server_in, push) + max(server_out, pull)) * per_byte
    own = cpu + 2 * alpha + (push + pull) * per_byte
    return max(own, server_in * per_byte, server_out * per_byte)


def predict_step(
    compute: ComputeTime,
    cost: MethodCost,
    link: Link,
    world_size: int,
    *,
    overlap: bool = True,
) -> StepPrediction:
    """Predict one step of ``cost.method``: its time and how it splits (see the module
    docstring for the overlap assumption)."""
    step = step_time(compute, cost, link, world_size, overlap=overlap)
    # local SGD and DiLoCo exchange once per round of H steps: per step, 1/H of it
    per = int(cost.options.get("sync_every", 1)) if cost.schedule == "local" else 1  # type: ignore[call-overload]
    return StepPrediction(
        method=cost.method,
        world_size=world_size,
        bandwidth_bps=link.bandwidth_bps,
        latency_s=link.latency_s,
        step_s=step,
        compute_s=compute.total,
        compress_s=cost.compress_s / per,
        comm_s=cost.comm_time(world_size, link) / per,
        exposed_comm_s=max(0.0, step - compute.total - cost.compress_s / per),
        payload_bytes=round(cost.payload_bytes / per),
        sent_bytes=cost.sent_bytes(world_size) / per,
        collectives=cost.collectives,
        compression_ratio=cost.compression_ratio * per,
    )


def _check_factor(factor: float) -> None:
    if not (factor > 0 and math.isfinite(factor)):
        raise ValueError(f"scale factor must be a finite number > 0, got {factor!r}")

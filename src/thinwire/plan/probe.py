"""Links measured, not assumed: ``thinwire probe`` times each level of the topology.

Run on every rank of the cluster the plan is for, before planning (``torchrun ... -m
thinwire probe --out links.json``, or ``thinwire cluster run -- thinwire probe`` on the
emulated cluster). Ranks ``h * ranks_per_host ...`` share host ``h``, as torchrun numbers
them. What it measures, each the median of a few repeats (of the slowest rank's time in
each: :func:`median_of_slowest`) over sizes that grow until a transfer takes long enough
to time:

* **between hosts, point to point** (the pipeline's messages): a message there and a
  4-byte reply back, as torch's pipelining sends them over gloo. gloo sends only after the
  receiver's "ready" note, so a round trip of ``S`` bytes takes ``3 L + S * beta``: the
  line through the sizes gives the one-way latency ``L`` and ``beta`` (seconds per byte).
  How much earlier the send completes than the round trip says how much of a message the
  sender's socket buffer takes. Once with one pair, once with every rank of host 0 sending
  to its counterpart on host 1 at once (how the host's link is shared), and then whether
  messages sent together are served in turn or side by side
  (:mod:`thinwire.plan.probe_sharing`).
* **all-reduce within a host**, for every group size dividing ``ranks_per_host`` (all of
  a host's groups at once, as tensor parallelism runs them), and **between hosts** (one
  rank per host; alone, and all local ranks' groups at once): ``2 (n - 1)`` ring steps of
  ``alpha`` and ``2 (n - 1) / n * S * beta``, fitted the same way.
* **all-reduces side by side**: at every size, two issued at once on the same group, and
  the share of one's latency the second hides (:attr:`Fit.overlaps`); and how many
  collectives a group runs at once (gloo: its worker threads, two by default), which
  sub-batches' all-reduces queue behind.
* **the CPU's sharing**: one optimizer-sized job on one rank alone, then on every rank at
  once. On GPUs the optimizer runs on the accelerator; on a host whose ranks share cores
  (the emulated cluster) its CPU work slows by this factor.

Every timing is of a run of the same transfer back to back (up to :data:`BACK_TO_BACK`,
fewer where one takes long), divided by their number: a run starts at a barrier, and
ranks leave a barrier milliseconds apart on a loaded host, which one transfer timed alone
would count as its latency (on the emulated 2 x 4 cluster at 1 Gbit/s a 256 KB
all-reduce of four ranks took 13.0 ms timed alone after a barrier, 7.7 ms a piece back
to back, as tensor parallelism issues them).

:class:`LinkProbe` holds the fits (and the raw samples) and saves to JSON;
:mod:`thinwire.plan.hybrid_cost` turns them into the planner's links.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from thinwire.plan.cpu_sharing import probe_slowdowns
from thinwire.plan.probe_sharing import probe_sharing, share_at

#: collectives a gloo process group runs at once: one per worker thread, two unless its
#: options say otherwise (PyTorch's default; probes from before thinwire read it assume it)
GLOO_THREADS = 2
#: message sizes start here and grow fourfold until a transfer takes ``target_s``
FIRST_BYTES = 64 * 1024
LARGEST_BYTES = 64 * 1024 * 1024
#: the most transfers of one size timed back to back (one run of them a repeat)
BACK_TO_BACK = 8


@dataclass(frozen=True)
class Fit:
    """``seconds = steps * alpha_s + wire_bytes * beta_s`` fitted to samples."""

    alpha_s: float
    beta_s: float
    samples: tuple[tuple[float, float], ...] = ()
    """(bytes, median seconds) per size measured."""
    overlap: float = 0.0
    """The share of an all-reduce's latency (``steps * alpha_s``) hidden when a second
    runs beside it on the group (two issued at once, measured at the two smallest sizes,
    where latency dominates); ``0``: none, as for a probe from before thinwire measured it."""
    overlaps: tuple[tuple[float, float], ...] = ()
    """(bytes, share hidden) with two issued at once, at each size measured: how much
    overlaps changes with the size (TCP's windows fill differently); empty in a probe from
    before thinwire measured it per size (:attr:`overlap` is used for every size then)."""

    def overlap_at(self, nbytes: float) -> float:
        """The share of latency hidden at ``nbytes``: between the two sizes measured on
        either side (linear in the size's logarithm), the nearest one's outside them."""
        found = share_at(self.overlaps, nbytes)
        return self.overlap if found is None else found

    @property
    def bandwidth_bps(self) -> float:
        """Bits per second the fit's ``beta`` stands for."""
        return 8.0 / self.beta_s if self.beta_s > 0 else float("inf")


@dataclass(frozen=True)
class PointToPoint:
    """Messages between two hosts: one-way ``latency_s``, ``beta_s`` per byte with
    ``pairs`` pairs sending at once, and the socket buffer's share of a send."""

    latency_s: float
    beta_s: float
    buffer_bytes: float
    pairs: int
    samples: tuple[tuple[float, float], ...] = ()
    in_turn: tuple[tuple[float, float], ...] = ()
    """(bytes, share of the link served in turn) with ``pairs`` messages sent at once
    (:mod:`thinwire.plan.probe_sharing`); empty for one pair, or in a probe from before
    thinwire measured it."""


@dataclass(frozen=True)
class LinkProbe:
    """What ``thinwire probe`` measured on a cluster (see the module docstring)."""

    hosts: int
    ranks_per_host: int
    point_to_point: tuple[PointToPoint, ...]
    """Between hosts: one pair alone, then every rank of a host at once (none: 1 host)."""
    intra_allreduce: dict[int, Fit]
    """Within a host, by group size (every host's groups running at once)."""
    inter_allreduce: dict[int, Fit]
    """Between hosts, one rank per host, by how many such groups ran at once."""
    cpu_slowdown: float
    """A CPU job on every rank at once, over the same job alone."""
    notes: dict[str, Any] = field(default_factory=dict)
    collectives_at_once: int = GLOO_THREADS
    """How many collectives one process group runs at the same time (gloo: its worker
    threads, read from the default group; PyTorch makes every gloo group alike; NCCL: one,
    its stream); more issued together wait their turn."""
    cpu_slowdowns: tuple[tuple[int, float], ...] = ()
    """(ranks running the CPU job at once, slowdown) from 1 to every rank
    (:mod:`thinwire.plan.cpu_sharing`); empty in a probe from before it was measured."""

    def save(self, path: str | Path) -> Path:
        """Write the probe as JSON."""
        path = Path(path)
        path.write_text(json.dumps(asdict(self), indent=1) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> LinkProbe:
        """Read a probe ``save`` wrote; a file that is not one is refused with a reason."""
        try:
            raw = json.loads(Path(path).read_text())
            return cls(
                hosts=int(raw["hosts"]),
                ranks_per_host=int(raw["ranks_per_host"]),
                point_to_point=tuple(_p2p(p) for p in raw["point_to_point"]),
                intra_allreduce={int(k): _fit(v) for k, v in raw["intra_allreduce"].items()},
                inter_allreduce={int(k): _fit(v) for k, v in raw["inter_allreduce"].items()},
                cpu_slowdown=float(raw["cpu_slowdown"]),
                notes=dict(raw.get("notes", {})),
                collectives_at_once=int(raw.get("collectives_at_once", GLOO_THREADS)),
                cpu_slowdowns=tuple((int(c), float(x)) for c, x in raw.get("cpu_slowdowns", ())),
            )
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise ValueError(
                f"{path} is not a link probe ({error}): run 'thinwire probe --out {path}' on "
                "every rank of the cluster first"
            ) from error


def _fit(raw: dict[str, Any]) -> Fit:
    return Fit(
        float(raw["alpha_s"]),
        float(raw["beta_s"]),
        _pairs(raw.get("samples", ())),
        float(raw.get("overlap", 0.0)),
        _pairs(raw.get("overlaps", ())),
    )


def _p2p(raw: dict[str, Any]) -> PointToPoint:
    return PointToPoint(
        float(raw["latency_s"]),
        float(raw["beta_s"]),
        float(raw["buffer_bytes"]),
        int(raw["pairs"]),
        _pairs(raw.get("samples", ())),
        _pairs(raw.get("in_turn", ())),
    )


def _pairs(raw: Sequence[Sequence[float]]) -> tuple[tuple[float, float], ...]:
    return tuple((float(a), float(b)) for a, b in raw)


def fit_line(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares ``(intercept, slope)`` of ``y = intercept + slope * x``, the intercept
    kept >= 0 (a negative one is noise on a link with no measurable latency)."""
    if len(points) < 2:
        raise ValueError(f"a line needs two sizes measured, got {len(points)}")
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    slope, intercept = statistics.linear_regression(xs, ys)
    if intercept < 0:
        slope, intercept = sum(ys) / sum(xs), 0.0
    if slope <= 0:
        raise ValueError(f"times did not grow with size ({points}): probe with larger sizes")
    return intercept, slope


def hosts_of(world: int, ranks_per_host: int) -> int:
    """How many hosts ``world`` ranks fill, ``ranks_per_host`` each (refused unless whole)."""
    if isinstance(ranks_per_host, bool) or not isinstance(ranks_per_host, int):
        raise ValueError(f"ranks per host must be an integer, got {ranks_per_host!r}")
    if ranks_per_host < 1 or world % ranks_per_host:
        raise ValueError(
            f"{world} ranks cannot be hosts of {ranks_per_host}: pass --ranks-per-host "
            "(torchrun's --nproc-per-node)"
        )
    return world // ranks_per_host


def run_probe(ranks_per_host: int, target_s: float = 0.25, repeats: int = 3) -> LinkProbe:
    """Measure every level on the initialised default process group (every rank calls
    this); every rank returns the same probe."""
    import torch
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    hosts = hosts_of(world, ranks_per_host)
    torch.set_num_threads(1)
    p2p: list[PointToPoint] = []
    if hosts > 1:  # one pair, then (up to its largest size at least) every pair at once
        for pairs in sorted({1, ranks_per_host}):
            reached = p2p[0].samples[-1][0] if p2p else 0.0
            p2p.append(_probe_p2p(rank, ranks_per_host, pairs, target_s, repeats, reached))
    intra = {}
    for size in range(2, ranks_per_host + 1):
        if ranks_per_host % size == 0:
            groups = [
                list(range(h * ranks_per_host + s, h * ranks_per_host + s + size))
                for h in range(hosts)
                for s in range(0, ranks_per_host, size)
            ]
            intra[size] = _probe_allreduce(groups, target_s, repeats)
    inter: dict[int, Fit] = {}
    if hosts > 1:
        across = [[h * ranks_per_host + i for h in range(hosts)] for i in range(ranks_per_host)]
        for count in sorted({1, ranks_per_host}):
            reached = inter[1].samples[-1][0] if inter else 0.0
            inter[count] = _probe_allreduce(across, target_s, repeats, count, reached)
    slowdowns = probe_slowdowns(rank, world, repeats)
    return LinkProbe(
        hosts=hosts,
        ranks_per_host=ranks_per_host,
        point_to_point=tuple(p2p),
        intra_allreduce=intra,
        inter_allreduce=inter,
        cpu_slowdown=slowdowns[world],
        notes={"target_s": target_s, "repeats": repeats, "backend": dist.get_backend()},
        collectives_at_once=group_collectives_at_once(dist.group.WORLD),
        cpu_slowdowns=tuple(slowdowns.items()),
    )


def group_collectives_at_once(group: Any) -> int:
    """How many collectives ``group`` runs at once: a gloo group one per worker thread
    (PyTorch's default when its options cannot be read), any other backend one (NCCL
    runs a group's collectives on one stream)."""
    import torch.distributed as dist

    if dist.get_backend(group) != "gloo":
        return 1
    threads = gloo_threads(group)
    return GLOO_THREADS if threads is None else threads


def gloo_threads(group: Any) -> int | None:
    """The worker threads of gloo group ``group``, read through PyTorch's private
    accessors (``None`` where they are not there)."""
    import torch

    try:
        return int(group._get_backend(torch.device("cpu")).options._threads)
    except (AttributeError, RuntimeError, TypeError, ValueError):
        return None


def measured_sizes(
    measure: Callable[[int, int], float], target_s: float, at_least: float = 0.0
) -> list[tuple[float, float]]:
    """Measure growing sizes (three at least, and up to ``at_least`` bytes) until one takes
    ``target_s``; every rank gets the same list (``measure(nbytes, count)`` times ``count``
    transfers back to back and returns the seconds of one, a time all ranks agree on).

    A level with several flows at once passes the largest size its one-flow level reached
    as ``at_least``: flows sharing a link reach ``target_s`` at smaller sizes, and a fit
    to those alone extrapolates to the large messages of a dense exchange from where the
    flows share the link least evenly (on the emulated 2 x 4 cluster at 100 Mbit/s, four
    groups fitted up to 1 MiB took 4.75x one group's time a byte, one group to 4 MiB; the
    dense exchanges of 2x1x4, 25 MB buckets, took 8.2-9.2 s where that predicted 10.7)."""
    samples, nbytes, seconds = [], FIRST_BYTES, 0.0
    while True:
        seconds = measure(nbytes, back_to_back(4 * seconds, target_s))
        samples.append((float(nbytes), seconds))
        done = seconds >= target_s and len(samples) >= 3 and nbytes >= at_least
        if done or nbytes * 4 > LARGEST_BYTES:
            return samples
        nbytes *= 4


def back_to_back(expected_s: float, target_s: float) -> int:
    """How many transfers expected to take ``expected_s`` each to time in a row: as many
    as fit in ``target_s``, at least one, at most :data:`BACK_TO_BACK` (all of them when
    nothing is known yet). Every rank passes the same agreed figures, so all issue the
    same number."""
    if expected_s <= 0:
        return BACK_TO_BACK
    return max(1, min(BACK_TO_BACK, int(target_s / expected_s)))


def _agreed(value: float) -> float:
    """The largest of every rank's ``value`` (one all-reduce)."""
    import torch
    import torch.distributed as dist

    tensor = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor.item())


def median_of_slowest(repeats: Sequence[Sequence[float]]) -> float:
    """The median over repeats of the slowest rank's time in each (``repeats[r][k]``:
    rank ``k``'s seconds in repeat ``r``). A plan waits for its last group every step,
    and which group is last changes from step to step (flows sharing a link are served
    unevenly): the median of each rank's own times, then the largest, misses that tail.
    On the emulated 2 x 4 cluster at 10 Mbit/s four host-crossing pairs gathering 681 KB
    at once took 2.52 s by that measure, 2.72 s by this one (5 repeats, 2.52-3.12 s)."""
    if not repeats or any(not times for times in repeats):
        raise ValueError("a probe's timing needs at least one repeat of at least one rank")
    return statistics.median(max(times) for times in repeats)


def slowest_rank_median(times: Sequence[float]) -> float:
    """:func:`median_of_slowest` over every rank's per-repeat ``times`` (each rank passes
    one time a repeat, 0 where it took no part; one all-gather)."""
    import torch
    import torch.distributed as dist

    mine = torch.tensor(list(times), dtype=torch.float64)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return median_of_slowest(torch.stack(every).T.tolist())


def _probe_p2p(
    rank: int, ranks_per_host: int, pairs: int, target_s: float, repeats: int,
    at_least: float = 0.0,
) -> PointToPoint:  # fmt: skip
    import torch
    import torch.distributed as dist

    local = rank % ranks_per_host
    sender = rank < ranks_per_host and local < pairs
    receiver = ranks_per_host <= rank < 2 * ranks_per_host and local < pairs
    peer = rank + ranks_per_host if sender else rank - ranks_per_host
    early: dict[int, float] = {}

    def measure(nbytes: int, count: int) -> float:
        data, reply = torch.zeros(nbytes // 4), torch.zeros(1)
        trips, gaps = [0.0] * repeats, []
        for repeat in range(repeats):
            dist.barrier()
            if sender:
                start = time.perf_counter()
                for _ in range(count):
                    began = time.perf_counter()
                    send = dist.isend(data, peer)
                    back = dist.irecv(reply, peer)
                    send.wait()
                    sent = time.perf_counter() - began
                    back.wait()
                    gaps.append(time.perf_counter() - began - sent)
                trips[repeat] = (time.perf_counter() - start) / count
            elif receiver:
                for _ in range(count):
                    dist.recv(data, peer)
                    dist.send(reply, peer)
        early[nbytes] = _agreed(statistics.median(gaps) if gaps else 0.0)
        return slowest_rank_median(trips)

    samples = measured_sizes(measure, target_s, at_least)
    intercept, beta = fit_line(samples)
    latency = intercept / 3
    largest = samples[-1][0]
    buffered_s = max(0.0, early[int(largest)] - 2 * latency)
    in_turn = (
        probe_sharing(rank, ranks_per_host, pairs, [b for b, _ in samples], repeats)
        if pairs > 1
        else ()
    )
    buffer_bytes = min(largest, buffered_s / beta)
    return PointToPoint(latency, beta, buffer_bytes, pairs, tuple(samples), in_turn)


def _probe_allreduce(
    groups: list[list[int]], target_s: float, repeats: int, running: int | None = None,
    at_least: float = 0.0,
) -> Fit:  # fmt: skip
    """All-reduce fit on ``groups`` (the first ``running`` of them at once, measured up to
    ``at_least`` bytes at least); every rank creates every group, as ``new_group``
    requires."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    handles = [dist.new_group(g) for g in groups]
    active = groups if running is None else groups[:running]
    mine = next(
        (h for g, h in zip(groups, handles, strict=True) if rank in g and g in active), None
    )
    size = len(groups[0])

    def measure(nbytes: int, count: int) -> float:
        data = torch.zeros(nbytes // 4)
        times = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            if mine is not None:
                for _ in range(count):
                    dist.all_reduce(data, group=mine)
            times.append((time.perf_counter() - start) / count)
        return slowest_rank_median(times)

    def measure_two(nbytes: int, count: int) -> float:
        first, second = torch.zeros(nbytes // 4), torch.zeros(nbytes // 4)
        times = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            if mine is not None:
                for _ in range(count):
                    both = [dist.all_reduce(t, group=mine, async_op=True) for t in (first, second)]
                    for work in both:
                        work.wait()
            times.append((time.perf_counter() - start) / count)
        return slowest_rank_median(times)

    samples = measured_sizes(measure, target_s, at_least)
    steps = 2 * (size - 1)
    alpha_total, beta = fit_line([(2 * (size - 1) / size * b, s) for b, s in samples])
    overlaps = tuple(
        (
            b,
            latency_overlap(
                measure_two(int(b), back_to_back(2 * s, target_s)),
                2 * (size - 1) / size * b * beta,
                alpha_total,
            ),
        )
        for b, s in samples
    )
    for handle in handles:
        dist.destroy_process_group(handle)
    latency_bound = statistics.mean(share for _, share in overlaps[:2])
    return Fit(alpha_total / steps, beta, tuple(samples), latency_bound, overlaps)


def latency_overlap(both_s: float, wire_s: float, latency_s: float) -> float:
    """The share of one all-reduce's latency ``latency_s`` hidden when two, each
    ``wire_s`` on the wire, took ``both_s`` together: 0 if they took twice one, 1 if the
    second added only its bytes (clamped to that range)."""
    if latency_s <= 0:
        return 0.0
    return min(1.0, max(0.0, 2 - (both_s - 2 * wire_s) / latency_s))

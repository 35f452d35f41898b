"""Links the planner reasons with when it has no probe, and a probe's links made faster or
slower: how ``thinwire plan --bandwidth`` describes a cluster, and how the planner finds the
bandwidth at which its choice would change.

A probe (``thinwire probe``) measures what a cluster's links do; :func:`nominal_probe`
writes down what a datasheet says instead: between hosts ``bandwidth`` and one-way
``latency``, shared fairly by the flows that cross at once; within a host a faster link
(by default 10 Gbit/s and 50 us, about what gloo gets over loopback between processes);
no socket buffering and no CPU sharing. Its figures are nominal, not measured: plan a real
cluster with its probe.
"""

from __future__ import annotations

from dataclasses import replace

from thinwire.plan.probe import Fit, LinkProbe, PointToPoint

#: the within-host link a nominal probe assumes (bits per second, seconds)
INTRA_BANDWIDTH_BPS = 10e9
INTRA_LATENCY_S = 50e-6


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def nominal_probe(
    hosts: int,
    ranks_per_host: int,
    bandwidth_bps: float,
    latency_s: float = 0.0,
    intra_bandwidth_bps: float = INTRA_BANDWIDTH_BPS,
    intra_latency_s: float = INTRA_LATENCY_S,
) -> LinkProbe:
    """A :class:`LinkProbe` of ``hosts`` x ``ranks_per_host`` ranks on the given links."""
    for name, value in (("hosts", hosts), ("ranks per host", ranks_per_host)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    rates = (("bandwidth", bandwidth_bps), ("within-host bandwidth", intra_bandwidth_bps))
    for name, value in rates:
        if not value or value <= 0:
            raise ValueError(f"{name} must be > 0 bits per second, got {value!r}")
    beta, intra_beta = 8.0 / bandwidth_bps, 8.0 / intra_bandwidth_bps
    flows = sorted({1, ranks_per_host})
    return LinkProbe(
        hosts=hosts,
        ranks_per_host=ranks_per_host,
        point_to_point=tuple(PointToPoint(latency_s, beta * pairs, 0.0, pairs) for pairs in flows)
        if hosts > 1
        else (),
        intra_allreduce={
            size: Fit(intra_latency_s, intra_beta) for size in _divisors(ranks_per_host)[1:]
        }
        or {1: Fit(intra_latency_s, intra_beta)},
        inter_allreduce={groups: Fit(latency_s, beta * groups) for groups in flows}
        if hosts > 1
        else {},
        cpu_slowdown=1.0,
        notes={"nominal": True, "bandwidth_bps": bandwidth_bps, "latency_s": latency_s},
    )


def between_hosts_bps(probe: LinkProbe) -> float | None:
    """The bandwidth one pair of ranks gets between two hosts (``None``: one host)."""
    alone = [p for p in probe.point_to_point if p.pairs == 1] or list(probe.point_to_point)
    if not alone:
        return None
    return 8.0 / alone[0].beta_s


def scale_between_hosts(probe: LinkProbe, factor: float) -> LinkProbe:
    """``probe`` with every link between hosts ``factor`` times as fast (bandwidth only:
    latencies and the links within a host stay as measured)."""
    if factor <= 0:
        raise ValueError(f"a link cannot be {factor} times as fast")
    return replace(
        probe,
        point_to_point=tuple(
            replace(p, beta_s=p.beta_s / factor, samples=()) for p in probe.point_to_point
        ),
        inter_allreduce={
            k: replace(f, beta_s=f.beta_s / factor, samples=())
            for k, f in probe.inter_allreduce.items()
        },
    )

"""Break-even bandwidths: where a method stops beating the dense reference, and a plan.

:func:`break_even_bandwidth` searches the bandwidth at which a method's predicted step
(:func:`thinwire.plan.cost.step_time`) stops being shorter than the reference's;
:func:`plan` predicts every method on one link and pairs each with its break-even.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from thinwire.plan.cost import ComputeTime, MethodCost, StepPrediction, predict_step, step_time
from thinwire.plan.network import Link, format_rate

#: the bandwidth range (bits/s) that :func:`break_even_bandwidth` searches
BREAK_EVEN_RANGE = (1e3, 1e12)


@dataclass(frozen=True)
class BreakEven:
    """Where a method stops beating the dense reference as bandwidth grows.

    ``verdict``: ``"below"`` (faster than dense below ``bandwidth_bps``, not above it),
    ``"always"`` (faster everywhere in the searched range), ``"never"`` (never faster).
    """

    verdict: str
    bandwidth_bps: float | None = None

    def describe(self) -> str:
        """A short human-readable form: ``"< 123 Mbit/s"``, ``"always"``, ``"never"``."""
        if self.verdict == "below":
            assert self.bandwidth_bps is not None
            return f"< {format_rate(self.bandwidth_bps)}"
        return self.verdict

    def as_dict(self) -> dict[str, object]:
        """A flat dict for JSON."""
        return {"verdict": self.verdict, "bandwidth_bps": self.bandwidth_bps}


def break_even_bandwidth(
    compute: ComputeTime,
    cost: MethodCost,
    reference: MethodCost,
    latency_s: float,
    world_size: int,
    *,
    link: Link | None = None,
    overlap: bool = True,
    search: tuple[float, float] = BREAK_EVEN_RANGE,
) -> BreakEven:
    """The bandwidth above which ``cost`` no longer beats ``reference`` (normally dense).

    Scans ``search`` (bits/s) on a log grid for the highest bandwidth at which the method's
    predicted step is strictly shorter, then bisects the crossing to 0.1 %. ``link`` gives
    the MTU and headers (its bandwidth is ignored); default: Ethernet MTU.
    """
    low, high = search
    if not 0 < low < high:
        raise ValueError(f"search range must satisfy 0 < low < high, got {search}")
    base = link if link is not None else Link(high, latency_s)
    base = replace(base, latency_s=latency_s)

    def gain(bandwidth: float) -> float:
        at = base.with_bandwidth(bandwidth)
        ours = step_time(compute, cost, at, world_size, overlap=overlap)
        theirs = step_time(compute, reference, at, world_size, overlap=overlap)
        return theirs - ours  # > 0: the method is faster

    tolerance = 1e-12
    grid = [low * (high / low) ** (i / 240) for i in range(241)]
    wins = [gain(b) > tolerance * max(1.0, compute.total) for b in grid]
    if not any(wins):
        return BreakEven("never")
    if wins[-1]:
        return BreakEven("always")
    last = max(i for i, win in enumerate(wins) if win)
    return BreakEven("below", _bisect(gain, grid[last], grid[last + 1], tolerance))


def _bisect(gain: Callable[[float], float], winning: float, losing: float, eps: float) -> float:
    """Bisect (in log space) the bandwidth between ``winning`` and ``losing`` to 0.1 %."""
    while losing / winning > 1.001:
        middle = math.sqrt(winning * losing)
        if gain(middle) > eps:
            winning = middle
        else:
            losing = middle
    return math.sqrt(winning * losing)


def plan(
    compute: ComputeTime,
    costs: Mapping[str, MethodCost],
    link: Link,
    world_size: int,
    *,
    reference: str = "dense",
    overlap: bool = True,
) -> list[tuple[StepPrediction, BreakEven | None]]:
    """Predict every method in ``costs`` and, for those that communicate, the bandwidth at
    which it stops beating ``costs[reference]`` (``None`` for the reference itself and for
    methods without communication, or when there is no reference)."""
    rows = []
    ref = costs.get(reference)
    for name, cost in costs.items():
        prediction = predict_step(compute, cost, link, world_size, overlap=overlap)
        verdict = None
        if ref is not None and name != reference and cost.buckets:
            verdict = break_even_bandwidth(
                compute, cost, ref, link.latency_s, world_size, link=link, overlap=overlap
            )
        rows.append((prediction, verdict))
    return rows


__all__ = [
    "BREAK_EVEN_RANGE",
    "BreakEven",
    "break_even_bandwidth",
    "plan",
]

"""Pipelines crossing one link between hosts: served in turn, side by side, or between.

The probe measures, per message size, the share of a link that messages sent together
are served in turn (:mod:`thinwire.plan.probe_sharing`): 1 where each is a burst the
link's queue holds whole (the pipelines drift apart: :mod:`thinwire.plan.schedule_sim`'s
first-in-first-out wire), 0 where the flows interleave and keep step (its fluid wire).
Measured shares fall between (four pairs at 100 Mbit/s on the emulated cluster: about
0.5), so the step is simulated both ways and weighed by the share measured at the plan's
message size; no weight is fitted to runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from thinwire.plan.probe import LinkProbe
from thinwire.plan.probe_sharing import share_at
from thinwire.plan.schedule_sim import PipelineTimes, simulate

#: a share this close to 0 or 1 is simulated one way only
CERTAIN = 0.05


def in_turn_for(probe: LinkProbe, nbytes: Sequence[float]) -> float:
    """The share served in turn for messages of ``nbytes`` (their mean over the sizes),
    from the probe's link with the most pairs; 1 (in turn, as the planner took it before
    the probe measured it) where the probe has no figure."""
    shared = max(probe.point_to_point, key=lambda p: p.pairs, default=None)
    shares = [share_at(shared.in_turn, b) for b in nbytes] if shared else []
    known = [share for share in shares if share is not None]
    return sum(known) / len(known) if known else 1.0


def simulate_shared(in_turn: float, **step: Any) -> PipelineTimes:
    """:func:`thinwire.plan.schedule_sim.simulate` with the links served ``in_turn``:
    the finishing times weighed between the two wires, the activations held the larger of
    the two (memory must fit either way), the timeline the weightier one's."""
    if not 0.0 <= in_turn <= 1.0:
        raise ValueError(f"the share served in turn is between 0 and 1, got {in_turn!r}")
    if in_turn >= 1 - CERTAIN or not step.get("links"):
        return simulate(**step, sharing="fifo")
    if in_turn <= CERTAIN:
        return simulate(**step, sharing="fluid")
    fifo, fluid = simulate(**step, sharing="fifo"), simulate(**step, sharing="fluid")

    def weigh(a: Sequence[float], b: Sequence[float]) -> tuple[float, ...]:
        return tuple(in_turn * x + (1 - in_turn) * y for x, y in zip(a, b, strict=True))

    return PipelineTimes(
        stage_end_s=weigh(fifo.stage_end_s, fluid.stage_end_s),
        stage_busy_s=fifo.stage_busy_s,
        peak_in_flight=tuple(
            max(pair) for pair in zip(fifo.peak_in_flight, fluid.peak_in_flight, strict=True)
        ),
        timeline=(fifo if in_turn >= 0.5 else fluid).timeline,
    )

"""Sub-batches in turns (:mod:`thinwire.parallel.subpipeline`), for the profiler and the
cost model: a stage profiled on one sub-batch stands for a micro-batch of ``n`` of them,
and a pass of ``n`` sub-batches taking turns lasts what :func:`in_turns_s` says.

The turns: each sub-batch computes up to its next tensor-parallel all-reduce, issues it
and hands the processor to the next sub-batch in a fixed round; it computes again when
its turn comes round and its all-reduce has finished. One processor computes at a time;
the all-reduces in flight share the link and hide the share of each other's latency
``thinwire probe`` measured with two at once (:mod:`thinwire.plan.inflight`); a process
group runs only so many collectives at once (gloo: one per worker thread, two by default;
:attr:`thinwire.plan.probe.LinkProbe.collectives_at_once`): the others wait, in the order
they were issued, for one of those to end.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from thinwire.plan.inflight import InFlight


@dataclass(frozen=True)
class TurnPass:
    """One sub-batch's pass, as the cost model sees it: compute ``gaps_s[k]`` before the
    ``k``-th all-reduce (of ``allreduces[k]`` bytes), then ``tail_s``."""

    gaps_s: tuple[float, ...] = ()
    allreduces: tuple[int, ...] = ()
    tail_s: float = 0.0

    def scaled(self, factor: float) -> TurnPass:
        """This pass with every compute ``factor`` times as long."""
        return replace(
            self, gaps_s=tuple(g * factor for g in self.gaps_s), tail_s=self.tail_s * factor
        )

    def then(self, other: TurnPass) -> TurnPass:
        """This pass followed by ``other`` (this one's tail runs before ``other``'s first
        all-reduce, or joins its tail)."""
        if not other.allreduces:
            return replace(self, tail_s=self.tail_s + other.tail_s)
        return TurnPass(
            (*self.gaps_s, self.tail_s + other.gaps_s[0], *other.gaps_s[1:]),
            (*self.allreduces, *other.allreduces),
            other.tail_s,
        )


def turn_pass(profile_pass: Any) -> TurnPass:
    """The :class:`TurnPass` of a profiled :class:`~thinwire.plan.stage_profile.Pass`."""
    return TurnPass(
        tuple(c.gap_s for c in profile_pass.collectives),
        tuple(c.nbytes for c in profile_pass.collectives),
        profile_pass.tail_s,
    )


def join_passes(passes: Sequence[TurnPass]) -> TurnPass:
    """``passes`` one after another, as one pass."""
    joined = TurnPass()
    for one in passes:
        joined = joined.then(one)
    return joined


def in_turns_s(
    one: TurnPass,
    parts: int,
    allreduce: Callable[[int], tuple[float, float]],
    at_once: int | None = None,
) -> float:
    """Seconds ``parts`` sub-batches take through ``one`` (each sub-batch's pass) in
    turns; ``allreduce(b)``: an all-reduce of ``b`` bytes' latency that another in flight
    hides, and the rest (its bytes on the wire and its latency that none hides). The
    all-reduces in flight share the link as :class:`~thinwire.plan.inflight.InFlight`
    says, at most ``at_once`` at a time (``None``: no limit)."""
    group = InFlight(at_once)
    clock = 0.0
    pending: list[int | None] = [None] * parts
    for gap, size in zip(one.gaps_s, one.allreduces, strict=True):
        hidden, rest = allreduce(size)
        for part in range(parts):
            waited = pending[part]
            if waited is not None:
                clock = max(clock, group.end(waited))
            clock += gap
            pending[part] = group.issue(clock, rest, hidden)
    for part in range(parts):
        waited = pending[part]
        if waited is not None:
            clock = max(clock, group.end(waited))
        clock += one.tail_s
    return clock


def _scaled(shape: tuple[int, ...], parts: int) -> tuple[int, ...]:
    return (shape[0] * parts, *shape[1:]) if shape else shape


def in_subbatches(profile: Any, parts: int) -> Any:
    """A :class:`~thinwire.plan.stage_profile.StageProfile` taken on one sub-batch, as the
    profile of a micro-batch of ``parts`` of them: its passes stay one sub-batch's (run
    ``parts`` times in turns), what it holds and sends per micro-batch ``parts`` times."""
    if parts == 1:
        return profile
    loss = tuple(replace(c, shape=_scaled(c.shape, parts)) for c in profile.loss_collectives)
    return replace(
        profile,
        subbatches=parts,
        output_shape=_scaled(profile.output_shape, parts),
        loss_collectives=loss,
        saved_bytes=profile.saved_bytes * parts,
        segment_saved=tuple(s * parts for s in profile.segment_saved),
        tail_saved_bytes=profile.tail_saved_bytes * parts,
        input_bytes=profile.input_bytes * parts,
        recompute_saved=profile.recompute_saved * parts,
    )

"""Sub-batches in turns (:mod:`thinwire.parallel.subpipeline`), for the profiler and the
cost model: a stage profiled on one sub-batch stands for a micro-batch of ``n`` of them,
and a pass of ``n`` sub-batches taking turns lasts what :func:`in_turns_s` says.

The turns: each sub-batch computes up to its next tensor-parallel all-reduce, issues it
and hands the processor to the next sub-batch in a fixed round; it computes again when
its turn comes round and its all-reduce has finished. One processor computes at a time;
the wire carries one all-reduce's bytes at a time (those issued earlier first), while
all-reduces in flight together overlap the share of their latency ``thinwire probe``
measured hidden with two at once (:meth:`thinwire.plan.probe.Fit.overlap_at`). A process
group runs only so many collectives at once (gloo: one per worker thread, two by default;
:attr:`thinwire.plan.probe.LinkProbe.collectives_at_once`): the others wait, in the order
they were issued, for one of those to end.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any


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
    turns; ``allreduce(b)``: an all-reduce of ``b`` bytes' latency and time on the wire.
    All-reduces in flight together share the wire (one's bytes after the other's) but
    not their latencies; at most ``at_once`` are in flight (``None``: no limit), a later
    one starting when the earliest of them ends."""
    if at_once is not None and at_once < 1:
        raise ValueError(f"at least one collective must run at a time, got at_once={at_once}")
    clock, wire_free = 0.0, 0.0
    done = [0.0] * parts
    threads = [0.0] * (at_once or parts)  # when each of the group's runners is free
    for gap, size in zip(one.gaps_s, one.allreduces, strict=True):
        latency, wire = allreduce(size)
        for part in range(parts):
            clock = max(clock, done[part]) + gap
            runner = min(range(len(threads)), key=threads.__getitem__)
            start = max(clock, threads[runner])
            wire_free = max(start, wire_free) + wire
            done[part] = threads[runner] = max(wire_free, start + latency + wire)
    for part in range(parts):
        clock = max(clock, done[part]) + one.tail_s
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

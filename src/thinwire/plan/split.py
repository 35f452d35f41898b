"""Where to cut a model into pipeline stages: Alpa's inter-operator objective by dynamic
programming, under a memory limit per rank.

A stage's time per micro-batch is the sum of its parts' (the embedding on the first stage,
its blocks, the head and loss on the last), each part measured once; a plan's pipeline
takes about ``sum(stage times) + (microbatches - 1) * max(stage times)`` (Alpa, eq. 2).
The sum does not depend on where the cuts fall (every part runs once per micro-batch), so
the best split is the one whose slowest stage is fastest, among the splits whose every
stage fits in memory: stage ``s`` holds its parts' static state plus the activations of the
micro-batches in flight on it (:func:`in_flight`), which is why under 1F1B the first
stages can take fewer blocks. :func:`best_split` finds it exactly in ``O(pp * blocks^2)``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from thinwire.parallel.interleaved_program import INTERLEAVED, held_in_turn


@dataclass(frozen=True)
class PartCost:
    """One part of the model as the split sees it: seconds per micro-batch (forward and
    backward, its tensor-parallel all-reduces included), bytes held whatever the
    micro-batches (parameters, gradients, optimizer and exchange state) and bytes saved
    per micro-batch in flight."""

    seconds: float
    static_bytes: int = 0
    saved_bytes: int = 0

    def __add__(self, other: PartCost) -> PartCost:
        return PartCost(
            self.seconds + other.seconds,
            self.static_bytes + other.static_bytes,
            self.saved_bytes + other.saved_bytes,
        )


def in_flight(schedule: str, stage: int, stages: int, microbatches: int) -> int:
    """Micro-batches whose activations stage ``stage`` holds at its peak: all of them
    under GPipe, ``min(m, stages - stage)`` under 1F1B; under interleaved 1F1B (``stages``
    counting both chunks of each rank) the most of its forwards not yet followed by their
    backward in its rank's compute order."""
    if schedule == "gpipe":
        return microbatches
    if schedule == INTERLEAVED:
        return _interleaved_peaks(stages // 2, microbatches)[stage]
    return min(microbatches, stages - stage)


@functools.lru_cache(maxsize=256)
def _interleaved_peaks(ranks: int, microbatches: int) -> tuple[int, ...]:
    peak = [0] * (2 * ranks)
    for rank in range(ranks):
        for held in held_in_turn(rank, ranks, microbatches):
            for stage, count in held.items():
                peak[stage] = max(peak[stage], count)
    return tuple(peak)


@dataclass(frozen=True)
class Split:
    """A split: where each stage after the first starts (block indices), each stage's
    seconds per micro-batch and peak bytes, and Alpa's objective for it."""

    boundaries: tuple[int, ...]
    stage_s: tuple[float, ...]
    stage_bytes: tuple[int, ...]
    objective_s: float


def stage_part(
    first: PartCost, blocks: Sequence[PartCost], last: PartCost, start: int, end: int,
    stage: int, stages: int,
) -> PartCost:  # fmt: skip
    """The cost of stage ``stage`` holding blocks ``start:end``."""
    total = PartCost(0.0)
    for block in blocks[start:end]:
        total = total + block
    if stage == 0:
        total = total + first
    if stage == stages - 1:
        total = total + last
    return total


def split_cost(
    first: PartCost, blocks: Sequence[PartCost], last: PartCost, boundaries: Sequence[int],
    schedule: str, microbatches: int,
) -> Split:  # fmt: skip
    """The :class:`Split` of given ``boundaries`` (an even split, say)."""
    stages = len(boundaries) + 1
    edges = [0, *boundaries, len(blocks)]
    parts = [
        stage_part(first, blocks, last, edges[s], edges[s + 1], s, stages) for s in range(stages)
    ]
    held = [
        p.static_bytes + p.saved_bytes * in_flight(schedule, s, stages, microbatches)
        for s, p in enumerate(parts)
    ]
    seconds = [p.seconds for p in parts]
    return Split(
        tuple(boundaries),
        tuple(seconds),
        tuple(held),
        sum(seconds) + (microbatches - 1) * max(seconds),
    )


def best_split(
    first: PartCost, blocks: Sequence[PartCost], last: PartCost, stages: int, schedule: str,
    microbatches: int, memory_limit: int | None = None,
) -> Split | None:  # fmt: skip
    """The split of ``blocks`` into ``stages`` stages (each at least one block) with the
    fastest slowest stage among those whose every stage fits ``memory_limit`` bytes per
    rank (``None``: no limit); ``None`` if no split fits."""
    count = len(blocks)
    if stages < 1 or stages > count:
        raise ValueError(
            f"cannot cut {count} blocks into {stages} stages (each holds at least one block)"
        )
    # prefix sums as plain numbers: the search runs this for every plan it looks at
    seconds_to, static_to, saved_to = [0.0], [0], [0]
    for block in blocks:
        seconds_to.append(seconds_to[-1] + block.seconds)
        static_to.append(static_to[-1] + block.static_bytes)
        saved_to.append(saved_to[-1] + block.saved_bytes)
    held_at = [in_flight(schedule, stage, stages, microbatches) for stage in range(stages)]

    def cost(stage: int, start: int, end: int) -> float | None:
        seconds = seconds_to[end] - seconds_to[start]
        static, saved = static_to[end] - static_to[start], saved_to[end] - saved_to[start]
        for edge, part in ((0, first), (stages - 1, last)):
            if stage == edge:
                seconds += part.seconds
                static, saved = static + part.static_bytes, saved + part.saved_bytes
        if memory_limit is not None and static + saved * held_at[stage] > memory_limit:
            return None
        return seconds

    inf = float("inf")
    # best[s][end]: the slowest stage of the best way to put blocks :end into stages :s+1
    best = [[inf] * (count + 1) for _ in range(stages)]
    choice = [[0] * (count + 1) for _ in range(stages)]
    for end in range(1, count - stages + 2):
        seconds = cost(0, 0, end)
        if seconds is not None:
            best[0][end] = seconds
    for stage in range(1, stages):
        for end in range(stage + 1, count - stages + stage + 2):
            for start in range(stage, end):
                if best[stage - 1][start] == inf:
                    continue
                seconds = cost(stage, start, end)
                if seconds is None:
                    continue
                slowest = max(best[stage - 1][start], seconds)
                if slowest < best[stage][end]:
                    best[stage][end], choice[stage][end] = slowest, start
    if best[stages - 1][count] == inf:
        return None
    boundaries, end = [], count
    for stage in range(stages - 1, 0, -1):
        end = choice[stage][end]
        boundaries.append(end)
    return split_cost(first, blocks, last, tuple(reversed(boundaries)), schedule, microbatches)

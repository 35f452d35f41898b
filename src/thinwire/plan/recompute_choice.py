"""How much each pipeline stage recomputes under a memory limit: the least that fits.

Recomputation only costs time (a checkpointed block runs its forward twice), so each
stage recomputes the fewest of its blocks that bring what it holds under the limit. A stage
holding fewer micro-batches in flight (the later ones under 1F1B) needs fewer: that is
Merak's stage-aware recomputation, with the ratios read off the profiled costs rather
than off the first stage's by formula.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any


def least_recomputation(bytes_at: Callable[[float], int], blocks: int, limit: int) -> float | None:
    """The smallest fraction of a stage's ``blocks`` to recompute (a whole number of
    blocks) for which ``bytes_at(fraction)`` is at most ``limit``; ``None`` if even
    recomputing every block does not fit."""
    if blocks < 0:
        raise ValueError(f"a stage holds a number of blocks >= 0, got {blocks}")
    for count in range(blocks + 1):
        fraction = count / blocks if blocks else 0.0
        if bytes_at(fraction) <= limit:
            return fraction
    return None


def stage_memory(
    parts: Any, ranges: Sequence[range], schedule: str, microbatches: int,
    ratios: Sequence[float],
) -> list[int]:  # fmt: skip
    """Each stage's peak bytes per rank (:meth:`~thinwire.plan.hybrid_cost.StageCost.memory`)
    with the blocks ``ranges`` of profiled ``parts`` and recomputation ``ratios``."""
    from thinwire.plan.block_profiles import compose_stage
    from thinwire.plan.split import in_flight

    count = len(ranges)
    return [
        compose_stage(parts, blocks, first=s == 0, last=s == count - 1, recompute=ratios[s]).memory(
            in_flight(schedule, s, count, microbatches)
        )["total"]
        for s, blocks in enumerate(ranges)
    ]


def least_ratios(
    bytes_at: Callable[[int, float], int], blocks: Sequence[int], limit: int
) -> tuple[float, ...] | None:
    """Per stage ``s`` of ``blocks[s]`` blocks, the least recomputation for which
    ``bytes_at(s, fraction)`` is at most ``limit`` (``None`` if some stage does not fit
    even recomputing every block)."""
    ratios = []
    for stage, count in enumerate(blocks):
        ratio = least_recomputation(lambda r, stage=stage: bytes_at(stage, r), count, limit)
        if ratio is None:
            return None
        ratios.append(ratio)
    return tuple(ratios)

"""How much each pipeline stage recomputes under a memory limit: the least that fits.

Recomputation only costs time (a checkpointed block runs its forward twice), so each
stage recomputes the fewest of its blocks that bring what it holds under the limit. A stage
holding fewer micro-batches in flight (the later ones under 1F1B) needs fewer: that is
Merak's stage-aware recomputation, with the ratios read off the profiled costs rather
than off the first stage's by formula.
"""

from __future__ import annotations

from collections.abc import Callable


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

"""The cost model's count of what each rank of a hybrid plan sends per step, within its
host and to other hosts.

Pure arithmetic over the plan and a few sizes (no torch): every collective is gloo's ring
(an all-reduce of ``S`` bytes over ``n`` ranks sends ``2 (n - 1) S / n`` from each rank to
the next in the group's order; an all-gather of ``S`` per rank sends ``(n - 1) S``), a
pipeline boundary sends each micro-batch's hidden states forward and their gradient back,
from each rank of a stage to the rank at the same data- and tensor-parallel coordinates of
the next stage. Ranks ``h * ranks_per_host`` to ``(h + 1) * ranks_per_host - 1`` share host
``h`` (torchrun's order), so whether a send crosses hosts follows from the two ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class PlanSizes:
    """What one step of a plan moves, per rank, before placement.

    Attributes:
        pp, dp, tp: the degrees; ``chunks``: model chunks per pipeline rank (2 under
            interleaved 1F1B).
        microbatches: micro-batches per step.
        tp_allreduce_bytes: per stage index, the sizes of the all-reduces its ``"tp"``
            group runs per micro-batch (forward, backward and the loss's).
        activation_bytes: per stage index, the hidden states it sends the next stage per
            micro-batch (the gradient sent back is the same size).
        dp_bytes: per stage index, what one rank sends per step in its data-parallel
            exchange (the engine's ring count for the method).
    """

    pp: int
    dp: int
    tp: int
    chunks: int
    microbatches: int
    tp_allreduce_bytes: Sequence[Sequence[int]]
    activation_bytes: Sequence[int]
    dp_bytes: Sequence[float]

    @property
    def world_size(self) -> int:
        """Ranks the plan runs on."""
        return self.pp * self.dp * self.tp


def coordinates(rank: int, sizes: PlanSizes) -> tuple[int, int, int]:
    """``(pp, dp, tp)`` of ``rank`` on the mesh (tensor parallel innermost)."""
    return rank // (sizes.dp * sizes.tp), rank // sizes.tp % sizes.dp, rank % sizes.tp


class MeshShape(Protocol):
    """Anything with a plan's data- and tensor-parallel degrees."""

    dp: int
    tp: int


def rank_at(pp: int, dp: int, tp: int, sizes: MeshShape) -> int:
    """The global rank at mesh coordinates ``(pp, dp, tp)`` (tensor parallel innermost),
    for ``sizes`` of any plan (a :class:`PlanSizes`, a :class:`ParallelPlan`...)."""
    return (pp * sizes.dp + dp) * sizes.tp + tp


def rank_traffic(rank: int, sizes: PlanSizes, ranks_per_host: int) -> dict[str, float]:
    """The model's bytes ``rank`` sends per step: ``within_host`` and ``between_hosts``."""
    if ranks_per_host < 1:
        raise ValueError(f"ranks_per_host must be >= 1, got {ranks_per_host}")
    pp, dp, tp = coordinates(rank, sizes)
    sends: list[tuple[int, float]] = []  # (peer, bytes)
    stages = sizes.pp * sizes.chunks
    for chunk in range(sizes.chunks):
        index = pp + chunk * sizes.pp
        if sizes.tp > 1:
            ring = 2 * (sizes.tp - 1) / sizes.tp
            total = sum(sizes.tp_allreduce_bytes[index]) * sizes.microbatches
            sends.append((rank_at(pp, dp, (tp + 1) % sizes.tp, sizes), ring * total))
        activations = sizes.activation_bytes[index] * sizes.microbatches
        if index < stages - 1:
            nxt = index + 1
            sends.append((rank_at(nxt % sizes.pp, dp, tp, sizes), activations))
        if index > 0:
            previous = index - 1
            gradient = sizes.activation_bytes[previous] * sizes.microbatches
            sends.append((rank_at(previous % sizes.pp, dp, tp, sizes), gradient))
        if sizes.dp > 1:
            sends.append((rank_at(pp, (dp + 1) % sizes.dp, tp, sizes), sizes.dp_bytes[index]))
    host = rank // ranks_per_host
    within = sum(b for peer, b in sends if peer // ranks_per_host == host)
    between = sum(b for peer, b in sends if peer // ranks_per_host != host)
    return {"within_host": within, "between_hosts": between}


def plan_traffic(sizes: PlanSizes, ranks_per_host: int) -> list[dict[str, float]]:
    """:func:`rank_traffic` of every rank, in rank order."""
    return [rank_traffic(r, sizes, ranks_per_host) for r in range(sizes.world_size)]

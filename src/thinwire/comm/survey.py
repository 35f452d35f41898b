"""What a bucket's gradients are, checked once while a caller hands the same ones.

Before every exchange the engine needs, per tensor, its key, whether the compressor
takes it, its size and that it is floating point; over 60 tensors that is a few hundred
Python operations a step, as much host time as the exchange's kernels. A DDP hook hands
the same bucket's items (the same views of the same buffer) step after step, so the
engine surveys them once and keeps the survey while it is handed the very same list,
which the caller marks as such (:class:`KeptItems`); only the slots, which carry the
step, are made once per step. Other lists are surveyed at every exchange (a caller that
builds a new list each step, as ``DistributedOptimizer`` does, would otherwise leave its
gradients held here).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from thinwire.compress.base import Compressor, Slot, check_floating


@dataclass
class Survey:
    """A bucket's items: their keys, parameters, which ones the compressor takes (an
    empty tensor has nothing to compress: top-k would ask for 1 of 0 entries), their
    sizes and dtype."""

    keys: list[str]
    params: list[Tensor | None]
    compressed: list[bool]
    #: each gradient's number of values, and their total
    sizes: list[int]
    total: int
    #: the gradients' dtype, where they share one (else ``None``)
    dtype: torch.dtype | None
    _slots: tuple[tuple[int, int, int], StepSlots] | None = field(default=None, repr=False)
    _positions: dict[Any, list[Tensor] | None] = field(default_factory=dict, repr=False)

    def positions(
        self, runs: tuple[tuple[int, ...], ...], device: torch.device
    ) -> list[Tensor] | None:
        """For runs of these members (positions in the bucket), where they hold every
        gradient once: the positions of each run's values among the bucket's values side
        by side (made once per grouping and device); else ``None``."""
        key = (runs, device)
        if key not in self._positions:
            self._positions[key] = _run_positions(runs, self.sizes, device)
        return self._positions[key]

    def slots(self, step: int, world_size: int, rank: int) -> StepSlots:
        """Each tensor's slot at ``step`` (made once per step, each when first asked for:
        an element-wise run of a whole bucket asks for its first only)."""
        where = (step, world_size, rank)
        if self._slots is None or self._slots[0] != where:
            self._slots = (where, StepSlots(self.keys, step, world_size, rank))
        return self._slots[1]


class StepSlots(Sequence[Slot]):
    """The slots of ``keys`` at one step, each made when first asked for."""

    def __init__(self, keys: list[str], step: int, world_size: int, rank: int) -> None:
        self._keys, self._where = keys, (step, world_size, rank)
        self._made: list[Slot | None] = [None] * len(keys)

    def __len__(self) -> int:
        return len(self._keys)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        made = self._made[index]
        if made is None:
            made = self._made[index] = Slot(self._keys[index], *self._where)
        return made


def _run_positions(
    runs: tuple[tuple[int, ...], ...], sizes: list[int], device: torch.device
) -> list[Tensor] | None:
    if sorted(i for members in runs for i in members) != list(range(len(sizes))):
        return None
    starts = [0]
    for size in sizes[:-1]:
        starts.append(starts[-1] + size)
    return [
        torch.cat([torch.arange(starts[i], starts[i] + sizes[i]) for i in members]).to(device)
        for members in runs
    ]


def survey(items: Sequence[Any], compressor: Compressor) -> Survey:
    """Check and describe ``items`` (each with ``key``, ``grad`` and ``param``)."""
    grads = [item.grad for item in items]
    for item, grad in zip(items, grads, strict=True):
        if not grad.is_floating_point():
            check_floating(grad, f"gradient of {item.key!r}")
    sizes = [g.numel() for g in grads]
    dtypes = {g.dtype for g in grads}
    return Survey(
        keys=[item.key for item in items],
        params=[item.param for item in items],
        compressed=[n > 0 and compressor.compresses(g) for g, n in zip(grads, sizes, strict=True)],
        sizes=sizes,
        total=sum(sizes),
        dtype=dtypes.pop() if len(dtypes) == 1 else None,
    )


class KeptItems(list):
    """A list of (frozen) gradient items that its caller keeps and hands to the engine
    again and again, unchanged (a DDP hook's bucket)."""


class Surveys:
    """The surveys of :class:`KeptItems` lists, by identity; any other list is surveyed
    at each call. A survey holds neither the items nor their gradients, and the list only
    weakly: when DDP rebuilds its buckets, the old buffers are not kept alive here."""

    #: surveys kept at most (a model's buckets; more means the caller's lists changed)
    LIMIT = 256

    def __init__(self, compressor: Compressor) -> None:
        self.compressor = compressor
        self._kept: dict[int, tuple[weakref.ref, Survey]] = {}

    def of(self, items: Sequence[Any]) -> Survey:
        """``items``' survey: the kept one if this very kept list was surveyed before."""
        if not isinstance(items, KeptItems):
            return survey(items, self.compressor)
        kept = self._kept.get(id(items))
        if kept is not None and kept[0]() is items:
            return kept[1]
        if len(self._kept) >= self.LIMIT:
            self._kept.clear()
        known = survey(items, self.compressor)
        self._kept[id(items)] = (weakref.ref(items), known)
        return known

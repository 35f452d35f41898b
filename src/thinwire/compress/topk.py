"""Top-k sparsification: send the ``k = density * n`` entries of largest magnitude.

    idx    = argtop_k |g|
    send     (g[idx], idx)           fp32 values + int32 indices: 64 bits per kept entry
    mean   = (1/N) * sum over ranks of scatter(values_r at idx_r)

Indices differ between ranks, so payloads are gathered, not summed. Use with error
feedback (the default): the dropped entries wait in the residual.
"""

from __future__ import annotations

import math
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from thinwire.compress.base import (
    Aggregation,
    Compressor,
    Exchange,
    Exchanged,
    Request,
    Slot,
    check_fraction,
    num_selected,
)
from thinwire.compress.blocks import blocks_for, element_indices, gather_blocks, pick_blocks
from thinwire.compress.partitioned import Partitions
from thinwire.compress.partitioned_runs import partitioned_run
from thinwire.compress.registry import register_compressor


@register_compressor
@dataclass
class TopK(Compressor):
    """Exact top-k by magnitude (``torch.topk``).

    Options:
        density: fraction of entries kept, in (0, 1].
        partitioned: exchange through the partitioned sparse all-reduce
            (:mod:`thinwire.compress.partitioned`): every rank receives the global top-k
            of the summed entries, and its bytes do not grow with the number of ranks;
            off (the default), every rank's k entries are gathered by every rank. A
            tensor whose k entries gather in fewer bytes than the partitioned exchange
            sends (few ranks, small k) is still gathered. A bucket's tensors share one
            protocol (:mod:`thinwire.compress.partitioned_runs`). It applies k entries
            of the sum a step where N ranks gathering apply up to N k, so at many ranks
            it learns more slowly at the same ``density``: give it a higher one
            (docs/sparse.md, "Quality"), or keep more of the sum (``keep``).
        keep: with ``partitioned``, apply the global top ``keep * k`` of the sum while
            each rank still sends its k (an integer >= 1; 1, the default: the global
            top-k). At many ranks the ranks' picks barely overlap and a global top-k
            applies few of them; ``keep`` 4 applies four times as many for ``keep * k``
            entries back a rank instead of k (docs/sparse.md, "keep=K").
        rebalance_every: with ``partitioned``, steps between re-balancings of the index
            ranges the ranks own (0: equal ranges throughout).
        block: send blocks of this many contiguous values, chosen by their L2 norm, with
            one index per block (:mod:`thinwire.compress.blocks`): ``density`` of the
            values in ``4 * block + 4`` bytes a block, against 8 bytes a value one by
            one; 1 (the default) chooses values one by one. Gathered (not with
            ``partitioned``).
    """

    density: float = 0.01
    partitioned: bool = False
    keep: int = 1
    rebalance_every: int = 50
    block: int = 1

    name = "topk"
    summary = "top-k sparsification by magnitude (exact), values + int32 indices, gathered"
    aggregation = Aggregation.GATHER
    wants_error_feedback = True
    segmented = True

    def __post_init__(self) -> None:
        self.density = check_fraction("density", self.density)
        self._layouts: dict[tuple[tuple[torch.Size, ...], float], SegmentedTopK] = {}
        if not isinstance(self.partitioned, bool):
            raise ValueError(f"partitioned must be true or false, got {self.partitioned!r}")
        if isinstance(self.keep, bool) or not isinstance(self.keep, int) or self.keep < 1:
            raise ValueError(f"keep must be an integer >= 1, got {self.keep!r}")
        if self.keep > 1 and not self.partitioned:
            raise ValueError(
                f"keep={self.keep} only applies with partitioned=True (gathering applies "
                "every rank's k entries already); set partitioned=True or drop keep"
            )
        every = self.rebalance_every
        if isinstance(every, bool) or not isinstance(every, int) or every < 0:
            raise ValueError(f"rebalance_every must be an integer >= 0, got {every!r}")
        self._partitions = Partitions(every)
        if isinstance(self.block, bool) or not isinstance(self.block, int) or self.block < 1:
            raise ValueError(f"block must be an integer >= 1, got {self.block!r}")
        if self.block > 1 and self.partitioned:
            raise ValueError(
                "block > 1 and partitioned=True do not go together yet: blocks are gathered; "
                "choose one of them"
            )
        # blocks: each tensor on its own; partitioned: a bucket as one run of its own kind
        if self.partitioned or self.block > 1:
            self.segmented = False
        self.scatters = self.partitioned

    def compresses(self, tensor: Tensor) -> bool:
        """Tensors of one dimension (biases, norms) go dense."""
        return tensor.dim() > 1

    def bucket_as_segments(self, device: torch.device) -> bool:
        """With ``partitioned``, a bucket's compressed tensors go as one run
        (:func:`~thinwire.compress.partitioned_runs.partitioned_run`: each round's work
        for all of them at once)."""
        return self.partitioned

    def select(self, flat: Tensor, k: int, slot: Slot) -> Tensor:
        """Flat indices of the ``k`` entries of ``flat`` with largest magnitude."""
        return torch.topk(flat.abs(), k, sorted=False).indices

    def pick(self, flat: Tensor, k: int, slot: Slot) -> tuple[Tensor, Tensor]:
        """The ``k`` (index, value) pairs of ``flat`` to send: :meth:`select`'s indices
        and their values. A selection that may find fewer than ``k`` entries pads with a
        sent index and the value 0, which adds nothing where it lands."""
        indices = self.select(flat, k, slot)
        return indices, flat.index_select(0, indices)

    def exchange(self, tensor: Tensor, slot: Slot) -> Exchange:
        """Gather (values, indices) from every rank and scatter-add them (or, with
        ``partitioned``, the partitioned sparse all-reduce's global top-k)."""
        flat = tensor.reshape(-1)
        k = num_selected(flat.numel(), self.density_at(slot))
        if self.block > 1:
            chosen, values = self._pick_blocks(flat, k)
            mean = yield from gather_blocks(values, chosen, flat, self.block, slot.world_size)
            sent = element_indices(chosen, self.block, flat.numel())
            return Exchanged(mean=mean.view_as(tensor), local=None, sent_indices=sent)
        indices, values = self.pick(flat, k, slot)
        if self.partitioned:  # (gathered inside where partitioning does not pay)
            mean, applied, _ = yield from partitioned_run(
                [(indices, values)], [k], flat, [flat.numel()], [slot], self._partitions, self.keep
            )
            return Exchanged(mean=mean.view_as(tensor), local=None, sent_indices=applied)
        mean = yield from gather_sparse(values, indices, flat, slot.world_size)
        return Exchanged(mean=mean.view_as(tensor), local=None, sent_indices=indices)

    def exchange_segmented(
        self, flat: Tensor, shapes: Sequence[torch.Size], slots: Sequence[Slot]
    ) -> Exchange:
        """:meth:`exchange` for small tensors side by side in ``flat``: every tensor's
        exact top-k at once (rows of one padded matrix), gathered together; the same
        entries as each tensor's own exchange sends (exact top-k, whatever ``select``).
        With ``partitioned``, any tensors: each one's own selection, then the partitioned
        exchange for all of them at once."""
        if self.partitioned:
            return (yield from self._exchange_partitioned(flat, shapes, slots))
        density = self.density_at(slots[0])
        key = (tuple(shapes), density)
        layout = self._layouts.get(key)
        if layout is None:
            layout = self._layouts.setdefault(key, SegmentedTopK(shapes, density))
        indices = layout.select(flat)
        values = flat.index_select(0, indices)
        mean = yield from gather_sparse(values, indices, flat, slots[0].world_size)
        return Exchanged(mean=mean, local=None, sent_indices=indices, sent_counts=layout.ks)

    def _exchange_partitioned(
        self, flat: Tensor, shapes: Sequence[torch.Size], slots: Sequence[Slot]
    ) -> Exchange:
        """Tensors side by side, each choosing its entries as its own :meth:`exchange`
        would; their partitioned exchange (or gathering, where that sends less) as one."""
        sizes = [math.prod(shape) for shape in shapes]
        ks = [
            num_selected(size, self.density_at(slot))
            for size, slot in zip(sizes, slots, strict=True)
        ]
        picks, start = [], 0
        for size, k, slot in zip(sizes, ks, slots, strict=True):
            picks.append(self.pick(flat[start : start + size], k, slot))
            start += size
        mean, sent, counts = yield from partitioned_run(
            picks, ks, flat, sizes, slots, self._partitions, self.keep
        )
        return Exchanged(mean=mean, local=None, sent_indices=sent, sent_counts=counts)

    def _pick_blocks(self, flat: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """The blocks that carry about ``k`` values of ``flat`` (``block`` > 1)."""
        return pick_blocks(flat, blocks_for(k, self.block, flat.numel()), self.block)

    def density_at(self, slot: Slot) -> float:
        """The density used at ``slot.step`` (constant here; DGC warms up)."""
        return self.density

    def decompress(self, payload: Sequence[Tensor], ctx: Any) -> Tensor:
        """Scatter one (values, indices) payload into a dense tensor of ``ctx`` numel
        (added, so that a padding entry, a repeated index with the value 0, adds nothing)."""
        values, indices = payload
        if self.block > 1:  # every value of each block, but none past the tensor's end
            inside = element_indices(indices, self.block, math.inf)
            keep = inside < ctx
            indices, values = inside[keep], values[keep]
        out = torch.zeros(ctx, dtype=values.dtype, device=values.device)
        return out.index_add_(0, indices.long(), values)

    def compress(self, tensor: Tensor, slot: Slot) -> tuple[list[Tensor], Any]:
        """Encode for inspection and tests: ``([values, int32 indices], numel)``."""
        flat = tensor.reshape(-1)
        k = num_selected(flat.numel(), self.density_at(slot))
        if self.block > 1:
            chosen, values = self._pick_blocks(flat, k)
            return [values, chosen.to(torch.int32)], flat.numel()
        indices, values = self.pick(flat, k, slot)
        return [values, indices.to(torch.int32)], flat.numel()


def gather_sparse(
    values: Tensor, indices: Tensor, like: Tensor, world_size: int
) -> Generator[Request, Any, Tensor]:
    """Gather every rank's ``values`` at its flat ``indices`` (sent as int32) and return
    their mean, scatter-added into a tensor shaped as the flat ``like``."""
    gathered = yield Request.gather(values, indices.to(torch.int32))
    mean = torch.zeros_like(like)
    for rank_values, rank_indices in gathered:
        mean.index_add_(0, rank_indices.long(), rank_values)
    return mean.div_(world_size)


class SegmentedTopK:
    """The exact top-k of each of several tensors side by side in one flat tensor, with a
    fixed number of kernels whatever their count. Made once per layout and density.

    Two ways, the same entries: on a GPU the magnitudes are laid as the rows of one matrix
    padded with -1 (below every magnitude) and one ``torch.topk`` takes each row's largest,
    a mask keeping each row's own ``k`` (one kernel each, whatever the sizes); on the CPU,
    where a top-k over padded rows costs several times the rows' own (2.4 ms against 0.8
    for 32 matrices of 64 x 64 beside their 32 biases), the tensors of each size are taken
    together, one ``torch.topk`` per size over rows of that size alone."""

    def __init__(self, shapes: Sequence[torch.Size], density: float) -> None:
        sizes = [math.prod(shape) for shape in shapes]
        self.ks = [num_selected(size, density) for size in sizes]
        self.rows, self.width, self.kmax = len(sizes), max(sizes), max(self.ks)
        #: per kept entry, k / n of its tensor
        self._fraction = torch.cat(
            [torch.full((k,), k / size) for k, size in zip(self.ks, sizes, strict=True)]
        )
        starts = [0]
        for size in sizes[:-1]:
            starts.append(starts[-1] + size)
        self._starts = torch.tensor(starts, dtype=torch.int64).unsqueeze(1)
        self._places = torch.cat(
            [torch.arange(size) + row * self.width for row, size in enumerate(sizes)]
        )
        keep = torch.arange(self.kmax).unsqueeze(0) < torch.tensor(self.ks).unsqueeze(1)
        self._keep = keep.view(-1).nonzero().view(-1)  # where each row's own k lie
        self._on: dict[torch.device, tuple[Tensor, Tensor, Tensor]] = {}
        #: tensors of one size need no padding; of one k, no sorting (a row's first k of
        #: its sorted top-kmax are its own k only where the k differ) and no mask
        self._same_size = min(sizes) == self.width
        self._same_k = min(self.ks) == self.kmax
        self._sizes = _SizeGroups(sizes, starts, self.ks)

    def select(self, flat: Tensor, padded: bool = False) -> Tensor:
        """Flat indices of each tensor's top k by magnitude, grouped by tensor in order
        (within a tensor in no particular order where every tensor keeps the same k).
        ``padded``: take the padded matrix's way (always off the CPU) rather than each
        size's alone (the CPU's default); the same entries either way."""
        on_cpu = flat.device.type == "cpu"
        if on_cpu and not padded and not self._same_size:
            return self._sizes.select(flat)
        starts, places, keep = self._moved(flat.device)
        if self._same_size:
            magnitudes = flat.abs().view(self.rows, self.width)
        else:
            laid = flat.new_full((self.rows * self.width,), -1.0)
            magnitudes = laid.index_copy_(0, places, flat.abs()).view(self.rows, self.width)
        top = torch.topk(magnitudes, self.kmax, dim=1, sorted=not self._same_k).indices
        if self._same_k:
            return (top + starts).view(-1)
        return (top + starts).view(-1).index_select(0, keep)

    def kept_fraction(self, device: torch.device) -> Tensor:
        """Per kept entry (in :meth:`select`'s order), the fraction k / n of its tensor."""
        return self._fraction.to(device)

    def _moved(self, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
        moved = self._on.get(device)
        if moved is None:
            moved = (self._starts.to(device), self._places.to(device), self._keep.to(device))
            self._on[device] = moved
        return moved


class _SizeGroups:
    """:class:`SegmentedTopK`'s way on the CPU: the tensors of each size as the rows of one
    matrix (a view where they lie one after another, else gathered), one unsorted top-k
    per size, and the indices put back in the tensors' order."""

    def __init__(self, sizes: list[int], starts: list[int], ks: list[int]) -> None:
        members: dict[int, list[int]] = {}
        for i, size in enumerate(sizes):
            members.setdefault(size, []).append(i)
        #: per size: (size, k, first value if its tensors lie one after another else
        #: the gather of their values, each row's start in the flat tensor)
        self.groups: list[tuple[int, int, int | Tensor, Tensor]] = []
        taken: list[int] = []  # the tensors in the order the groups emit their entries
        for size, rows in members.items():
            first = starts[rows[0]]
            adjacent = all(starts[r] == first + j * size for j, r in enumerate(rows))
            source: int | Tensor = (
                first if adjacent else torch.cat([torch.arange(size) + starts[r] for r in rows])
            )
            row_starts = torch.tensor([starts[r] for r in rows]).unsqueeze(1)
            self.groups.append((size, ks[rows[0]], source, row_starts))
            taken += rows
        # where each tensor's k entries lie among the groups' outputs
        at: dict[int, int] = {}
        offset = 0
        for r in taken:
            at[r] = offset
            offset += ks[r]
        order = torch.cat([torch.arange(ks[r]) + at[r] for r in range(len(sizes))])
        identity = taken == sorted(taken)
        self.order: Tensor | None = None if identity else order

    def select(self, flat: Tensor) -> Tensor:
        """The flat indices of every tensor's top k, grouped by tensor in order."""
        parts = []
        for size, k, source, row_starts in self.groups:
            if isinstance(source, int):
                magnitudes = flat.narrow(0, source, row_starts.numel() * size).abs()
            else:
                magnitudes = flat.index_select(0, source).abs_()
            top = torch.topk(magnitudes.view(-1, size), k, dim=1, sorted=False).indices
            parts.append((top + row_starts).view(-1))
        indices = parts[0] if len(parts) == 1 else torch.cat(parts)
        return indices if self.order is None else indices.index_select(0, self.order)

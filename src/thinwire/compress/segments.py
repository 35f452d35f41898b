"""Segments of a flat tensor: many small tensors (or their rows) side by side, reduced and
expanded with a fixed number of kernels whatever their count.

A compressor that scales per tensor or per row (1-bit SGD, signSGD) computes one scale per
*segment*; over a bucket of small tensors laid side by side, :meth:`Segments.sums` takes
every segment's sum with a couple of kernels and :meth:`Segments.expand` spreads one value
per segment back over its values in another, where a loop over the tensors would launch a
few kernels each. Sums are taken in fp64, each segment's alone: on the CPU by
``torch.segment_reduce`` (in order, deterministic); on a GPU by an fp64 ``index_add_``,
since ``segment_reduce`` makes the host wait there (it reads the lengths back). A GPU's
atomic adds may add in another order from one run to the next, which moves an fp64 sum by
about 1e-16 of itself, below what the fp32 results keep. (Differences of one running sum
would be deterministic but lose a small segment's sum beside large ones: on a GPU they
came out negative and made TernGrad's bound NaN.) Maxima are a scatter of the order-free
``amax``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

#: tensors of at most this many values are exchanged side by side by compressors that
#: take segments; larger ones alone (their own chunked, buffered paths are faster there)
SMALL = 1 << 16


def side_by_side(tensors: Sequence[Tensor]) -> Tensor | None:
    """The tensors as one flat tensor *without copying*, if they lie side by side in one
    storage (contiguous, same dtype, each starting where the last one ends); else
    ``None``."""
    first = tensors[0]
    storage = first.untyped_storage().data_ptr()
    expected, total = first.data_ptr(), 0
    for tensor in tensors:
        if (
            tensor.dtype != first.dtype
            or tensor.device != first.device
            or not tensor.is_contiguous()
            or tensor.untyped_storage().data_ptr() != storage
            or tensor.data_ptr() != expected
        ):
            return None
        expected += tensor.numel() * tensor.element_size()
        total += tensor.numel()
    return torch.as_strided(first, (total,), (1,), first.storage_offset())


class Segments:
    """Consecutive segments of the given ``lengths`` (each >= 1) covering a flat tensor."""

    def __init__(self, lengths: Sequence[int]) -> None:
        if not lengths or min(lengths) < 1:
            raise ValueError(f"segments need lengths >= 1, got {list(lengths)[:8]}")
        self.lengths = list(lengths)
        self.total = sum(self.lengths)
        self._on: dict[torch.device, tuple[Tensor, Tensor]] = {}

    def __len__(self) -> int:
        return len(self.lengths)

    def counts(self, device: torch.device) -> Tensor:
        """The lengths as an int64 tensor on ``device`` (made once per device)."""
        return self._moved(device)[0]

    def _moved(self, device: torch.device) -> tuple[Tensor, Tensor]:
        """(lengths, segment of each value) on ``device``, made once per device."""
        moved = self._on.get(device)
        if moved is None:
            lengths = torch.tensor(self.lengths, dtype=torch.int64)
            owner = torch.repeat_interleave(torch.arange(len(self.lengths)), lengths)
            moved = (lengths.to(device), owner.to(device))
            self._on[device] = moved
        return moved

    def sums(self, values: Tensor) -> Tensor:
        """Each segment's sum of the flat ``values`` (taken in fp64), in ``values``'
        dtype."""
        lengths, owner = self._moved(values.device)
        wide = values.to(torch.float64)
        if values.device.type == "cpu":
            return torch.segment_reduce(wide, "sum", lengths=lengths).to(values.dtype)
        out = torch.zeros(len(self.lengths), dtype=torch.float64, device=values.device)
        return out.index_add_(0, owner, wide).to(values.dtype)

    def max(self, values: Tensor) -> Tensor:
        """Each segment's largest value of the flat ``values``."""
        _, owner = self._moved(values.device)
        out = values.new_full((len(self.lengths),), float("-inf"))
        return out.scatter_reduce_(0, owner, values, "amax")

    def expand(self, per_segment: Tensor) -> Tensor:
        """``per_segment[i]`` repeated over segment ``i``'s values: a flat tensor."""
        _, owner = self._moved(per_segment.device)
        return per_segment.index_select(0, owner)


def row_segments(shapes: Sequence[torch.Size], rows_of: Any) -> Segments:
    """One segment per row of each tensor that ``rows_of(shape)`` gives rows for (their
    count), else one per tensor: the scales of the per-row quantizers."""
    lengths: list[int] = []
    for shape in shapes:
        numel = _numel(shape)
        rows = rows_of(shape)
        lengths += [numel // rows] * rows if rows is not None else [max(numel, 1)]
    return Segments(lengths)


def tensor_segments(shapes: Sequence[torch.Size]) -> Segments:
    """One segment per tensor of the given shapes."""
    return Segments([max(1, _numel(shape)) for shape in shapes])


def _numel(shape: torch.Size) -> int:
    count = 1
    for size in shape:
        count *= size
    return count

"""Segments of a flat tensor: many small tensors (or their rows) side by side, reduced and
expanded with a fixed number of kernels whatever their count.

A compressor that scales per tensor or per row (1-bit SGD, signSGD) computes one scale per
*segment*; over a bucket of small tensors laid side by side, :meth:`Segments.sums` takes
every segment's sum in one kernel and :meth:`Segments.expand` spreads one value per
segment back over its values in another, where a loop over the tensors would launch a
few kernels each.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

#: tensors of at most this many values are exchanged side by side by compressors that
#: take segments; larger ones alone (their own chunked, buffered paths are faster there)
SMALL = 1 << 16


class Segments:
    """Consecutive segments of the given ``lengths`` (each >= 1) covering a flat tensor."""

    def __init__(self, lengths: Sequence[int]) -> None:
        if not lengths or min(lengths) < 1:
            raise ValueError(f"segments need lengths >= 1, got {list(lengths)[:8]}")
        self.lengths = list(lengths)
        self.total = sum(self.lengths)
        self._on: dict[torch.device, Tensor] = {}

    def __len__(self) -> int:
        return len(self.lengths)

    def counts(self, device: torch.device) -> Tensor:
        """The lengths as an int64 tensor on ``device`` (made once per device)."""
        counts = self._on.get(device)
        if counts is None:
            counts = torch.tensor(self.lengths, dtype=torch.int64, device=device)
            self._on[device] = counts
        return counts

    def sums(self, values: Tensor) -> Tensor:
        """Each segment's sum of the flat ``values``, in ``values``' dtype."""
        return torch.segment_reduce(values, "sum", lengths=self.counts(values.device))

    def max(self, values: Tensor) -> Tensor:
        """Each segment's largest value of the flat ``values``."""
        return torch.segment_reduce(values, "max", lengths=self.counts(values.device))

    def expand(self, per_segment: Tensor) -> Tensor:
        """``per_segment[i]`` repeated over segment ``i``'s values: a flat tensor."""
        counts = self.counts(per_segment.device)
        return torch.repeat_interleave(per_segment, counts, output_size=self.total)


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

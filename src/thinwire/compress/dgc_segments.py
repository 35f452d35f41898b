"""DGC's threshold selection over several large tensors side by side, with a fixed number
of kernels whatever their count, and nothing read back on the host.

A bucket's large tensors (more than :data:`~thinwire.compress.segments.SMALL` values each)
lie side by side in one flat tensor, each a *segment*. Per step::

    sample   every segment's values at a stride, one gather (a random offset per step)
    thr_i    the a_i-th largest sample of segment i: one top-k over a padded matrix of
             the samples, a row per segment (a_i aims a little below k_i, so that more
             than k_i values pass only rarely)
    pass     |v| >= thr_i (and > 0), one comparison with thr_i spread over segment i
    keep     the first k_i that passed in segment i: a running count of passes, each
             segment's count before it subtracted
    slots    k_i slots per segment; the kept values go to their segment's slots in order
             (torch.nonzero_static: no count read back), a slot left empty repeats the
             segment's first index with the value 0, which adds nothing where it lands

so every segment sends exactly k_i (index, value) pairs, and the split per tensor needs no
count from the device. What is not sent stays in DGC's memory, as always. On a GPU with
Triton, everything after the thresholds runs in three kernels that send the same pairs
(:mod:`thinwire.compress.fused_segments`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from thinwire.compress import fused
from thinwire.compress.base import num_selected
from thinwire.compress.fused_segments import SegmentTables, pick_segments


class ThresholdSegments:
    """The threshold selection for tensors of ``shapes`` side by side at ``density``;
    ``stride_of(k)``: the sample stride for a segment sending ``k`` values. Made once
    per layout and density; its index tensors are moved to a device once."""

    def __init__(
        self, shapes: Sequence[torch.Size], density: float, stride_of: Callable[[int], int]
    ) -> None:
        sizes = [math.prod(shape) for shape in shapes]
        self.ks = [num_selected(size, density) for size in sizes]
        starts = [0]
        for size in sizes[:-1]:
            starts.append(starts[-1] + size)
        strides = [stride_of(k) for k in self.ks]
        #: the sample offset of a step is drawn below this (every sample stays inside)
        self.offsets = min(strides)
        counts = [
            (size - self.offsets) // stride + 1 for size, stride in zip(sizes, strides, strict=True)
        ]
        aims = [
            aim_below(k * count / size)
            for k, count, size in zip(self.ks, counts, sizes, strict=True)
        ]
        self.total, self.slots = sum(sizes), sum(self.ks)
        self.rows, self.width, self.aim_max = len(sizes), max(counts), max(aims)
        slot_starts = [0]
        for k in self.ks[:-1]:
            slot_starts.append(slot_starts[-1] + k)
        self._host = {
            "samples": torch.cat(
                [
                    start + torch.arange(count) * stride
                    for start, count, stride in zip(starts, counts, strides, strict=True)
                ]
            ),
            "places": torch.cat(
                [torch.arange(count) + row * self.width for row, count in enumerate(counts)]
            ),
            "aim_columns": torch.tensor([a - 1 for a in aims]).unsqueeze(1),
            "lengths": torch.tensor(sizes),
            "starts": torch.tensor(starts),
            "before": torch.tensor([max(s - 1, 0) for s in starts]),
            "first": torch.tensor([int(s > 0) for s in starts], dtype=torch.int32),
            "ks": torch.tensor(self.ks, dtype=torch.int32),
            "slot_starts": torch.tensor(slot_starts),
            "slot_segment": torch.repeat_interleave(
                torch.arange(len(sizes)), torch.tensor(self.ks)
            ),
        }
        self._on: dict[torch.device, dict[str, Tensor]] = {}
        self.sizes = sizes
        #: the fused kernels' tables, made at their first use
        self._tables: SegmentTables | None = None

    def _moved(self, device: torch.device) -> dict[str, Tensor]:
        moved = self._on.get(device)
        if moved is None:
            moved = {name: t.to(device) for name, t in self._host.items()}
            self._on[device] = moved
        return moved

    def pick(self, flat: Tensor, offset: int) -> tuple[Tensor, Tensor]:
        """``sum(ks)`` (index, value) pairs of the flat tensor, segment by segment (k_i
        slots each, in order); ``offset`` in ``[0, offsets)``: the step's sample offset."""
        at = self._moved(flat.device)
        samples = flat.index_select(0, at["samples"] + offset).abs()
        padded = flat.new_full((self.rows * self.width,), -1.0)
        padded.index_copy_(0, at["places"], samples)
        top = torch.topk(padded.view(self.rows, self.width), self.aim_max, dim=1).values
        threshold = top.gather(1, at["aim_columns"]).squeeze(1)
        threshold = threshold.clamp_min(torch.finfo(flat.dtype).tiny)  # a zero carries nothing
        if fused.available(flat.device):  # the same pairs in three kernels
            if self._tables is None:
                self._tables = SegmentTables(self.sizes, self.ks)
            return pick_segments(flat, threshold, self._tables)
        each = torch.repeat_interleave(threshold, at["lengths"], output_size=self.total)
        passed = flat.abs() >= each
        running = torch.cumsum(passed, 0, dtype=torch.int32)
        # passes before each segment (0 before the first), then each segment's last to keep
        before = running.index_select(0, at["before"]) * at["first"]
        limit = torch.repeat_interleave(before + at["ks"], at["lengths"], output_size=self.total)
        kept = passed & (running <= limit)
        found_at = torch.nonzero_static(kept, size=self.slots, fill_value=-1).view(-1)
        found = found_at >= 0
        safe = found_at.clamp_min(0)
        segment = torch.searchsorted(at["starts"], safe, right=True) - 1
        slot = at["slot_starts"][segment] + (running[safe] - 1 - before[segment]).long()
        slot = torch.where(found, slot, self.slots)  # unused entries: one spare slot
        indices = torch.full((self.slots + 1,), -1, dtype=torch.int64, device=flat.device)
        indices.scatter_(0, slot, found_at)  # the spare slot gets -1 only
        indices = indices[: self.slots]
        filled = indices >= 0
        # an empty slot repeats its segment's first kept index (or its start: all zero)
        firsts = indices[at["slot_starts"]]
        firsts = torch.where(firsts >= 0, firsts, at["starts"])
        indices = torch.where(filled, indices, firsts[at["slot_segment"]])
        values = flat.index_select(0, indices)
        return indices, torch.where(filled, values, values.new_zeros(()))


def aim_below(expected: float) -> int:
    """How many sampled values to put above the threshold when ``expected`` of the sample
    lie above the true k-th: two standard deviations below, so that more than k values
    pass only about once in 40 steps (at least one). With ``expected`` >= 256 (DGC
    samples that much where it can), about 7/8 of k pass."""
    return max(1, math.floor(expected - 2 * math.sqrt(expected)))

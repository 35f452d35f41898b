"""DGC's threshold selection over a bucket's large tensors (segments) in three Triton
kernels, where PyTorch's operations take about 35 (:mod:`thinwire.compress.dgc_segments`).

Each segment i has its threshold ``t_i`` and sends ``k_i`` (index, value) pairs in its own
slots: the first ``k_i`` of its values with ``|v| >= t_i``, in order, then, for slots left
empty, its first kept index (its start if none) with the value 0. The segments are cut in
blocks of :data:`~thinwire.compress.fused.BLOCK` values that never straddle two segments::

    count     each block's passes (one kernel)
    running   their running sum (torch.cumsum): where each block's passes start
    keep      each block's passes ranked within their segment; those ranked below k_i
              written to their slots (one kernel)
    pad       the empty slots filled (one kernel)

The same pairs, to the bit, as the PyTorch operations (``tests/test_fused_selection.py``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from thinwire.compress import fused

#: Triton's language, set at the first kernel (a global here for Triton's interpreter)
tl: Any = None


@functools.cache
def _kernels() -> Any:
    """The kernels, defined on first use (as :func:`thinwire.compress.fused._kernels`)."""
    global tl
    triton, tl = fused.triton_modules()

    @triton.jit
    def count_kernel(
        v_ptr, t_ptr, seg_ptr, start_ptr, end_ptr, counts_ptr, tiny, BLOCK: tl.constexpr
    ):
        block = tl.program_id(0)
        segment = tl.load(seg_ptr + block)
        offsets = tl.load(start_ptr + block) + tl.arange(0, BLOCK)
        inside = offsets < tl.load(end_ptr + block)
        v = tl.load(v_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
        t = tl.maximum(tl.load(t_ptr + segment).to(tl.float32), tiny)
        passed = ((tl.abs(v) >= t) & inside).to(tl.int32)
        tl.store(counts_ptr + block, tl.sum(passed, axis=0))

    @triton.jit
    def keep_kernel(
        v_ptr,
        t_ptr,
        seg_ptr,
        start_ptr,
        end_ptr,
        counts_ptr,
        running_ptr,
        first_block_ptr,
        ks_ptr,
        slot_starts_ptr,
        index_ptr,
        value_ptr,
        tiny,
        BLOCK: tl.constexpr,
    ):
        block = tl.program_id(0)
        segment = tl.load(seg_ptr + block)
        offsets = tl.load(start_ptr + block) + tl.arange(0, BLOCK)
        inside = offsets < tl.load(end_ptr + block)
        v = tl.load(v_ptr + offsets, mask=inside, other=0.0)
        t = tl.maximum(tl.load(t_ptr + segment).to(tl.float32), tiny)
        passed = ((tl.abs(v.to(tl.float32)) >= t) & inside).to(tl.int32)
        first = tl.load(first_block_ptr + segment)
        # passes in this segment before this block
        before = tl.load(running_ptr + block) - tl.load(counts_ptr + block)
        before -= tl.load(running_ptr + first) - tl.load(counts_ptr + first)
        rank = before + tl.cumsum(passed, axis=0) - passed
        keep = (passed > 0) & (rank < tl.load(ks_ptr + segment))
        slot = tl.load(slot_starts_ptr + segment) + rank
        tl.store(index_ptr + slot, offsets, mask=keep)
        tl.store(value_ptr + slot, v, mask=keep)

    @triton.jit
    def pad_kernel(
        index_ptr,
        value_ptr,
        slot_seg_ptr,
        slot_starts_ptr,
        ks_ptr,
        counts_ptr,
        running_ptr,
        first_block_ptr,
        last_block_ptr,
        starts_ptr,
        slots,
        BLOCK: tl.constexpr,
    ):
        at = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        inside = at < slots
        segment = tl.load(slot_seg_ptr + at, mask=inside, other=0)
        first = tl.load(first_block_ptr + segment, mask=inside, other=0)
        last = tl.load(last_block_ptr + segment, mask=inside, other=0)
        passes = tl.load(running_ptr + last, mask=inside, other=0)
        passes -= tl.load(running_ptr + first, mask=inside, other=0)
        passes += tl.load(counts_ptr + first, mask=inside, other=0)
        kept = tl.minimum(passes, tl.load(ks_ptr + segment, mask=inside, other=0))
        slot_start = tl.load(slot_starts_ptr + segment, mask=inside, other=0)
        empty = inside & (at - slot_start >= kept)
        first_kept = tl.load(index_ptr + slot_start, mask=empty & (kept > 0), other=0)
        start = tl.load(starts_ptr + segment, mask=inside, other=0)
        tl.store(index_ptr + at, tl.where(kept > 0, first_kept, start), mask=empty)
        tl.store(value_ptr + at, tl.zeros([BLOCK], dtype=value_ptr.dtype.element_ty), mask=empty)

    return count_kernel, keep_kernel, pad_kernel


class SegmentTables:
    """The blocks and slots of segments of ``sizes`` sending ``ks`` each, as index tensors
    (made once per layout; moved once per device)."""

    def __init__(self, sizes: Sequence[int], ks: Sequence[int]) -> None:
        block_segment, block_start, block_end, first_block, last_block = [], [], [], [], []
        start = 0
        for segment, size in enumerate(sizes):
            first_block.append(len(block_segment))
            for at in range(start, start + size, fused.BLOCK):
                block_segment.append(segment)
                block_start.append(at)
                block_end.append(min(at + fused.BLOCK, start + size))
            last_block.append(len(block_segment) - 1)
            start += size
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        slot_starts = [sum(ks[:i]) for i in range(len(ks))]
        self.blocks, self.slots = len(block_segment), sum(ks)
        self._host = {
            "block_segment": torch.tensor(block_segment, dtype=torch.int32),
            "block_start": torch.tensor(block_start, dtype=torch.int64),
            "block_end": torch.tensor(block_end, dtype=torch.int64),
            "first_block": torch.tensor(first_block, dtype=torch.int32),
            "last_block": torch.tensor(last_block, dtype=torch.int32),
            "ks": torch.tensor(list(ks), dtype=torch.int32),
            "slot_starts": torch.tensor(slot_starts, dtype=torch.int64),
            "starts": torch.tensor(starts, dtype=torch.int64),
            "slot_segment": torch.repeat_interleave(
                torch.arange(len(ks), dtype=torch.int32), torch.tensor(list(ks))
            ),
        }
        self._on: dict[torch.device, dict[str, Tensor]] = {}

    def on(self, device: torch.device) -> dict[str, Tensor]:
        """The tables on ``device``."""
        moved = self._on.get(device)
        if moved is None:
            moved = self._on[device] = {k: t.to(device) for k, t in self._host.items()}
        return moved


def pick_segments(flat: Tensor, thresholds: Tensor, tables: SegmentTables) -> tuple[Tensor, Tensor]:
    """Each segment's k_i (index, value) pairs at or above its threshold (one per
    segment, on ``flat``'s device), in its slots; see the module docstring."""
    count_kernel, keep_kernel, pad_kernel = _kernels()
    at = tables.on(flat.device)
    tiny = torch.finfo(flat.dtype).tiny
    counts = torch.empty(tables.blocks, dtype=torch.int32, device=flat.device)
    blocks = (tables.blocks,)
    common = (at["block_segment"], at["block_start"], at["block_end"])
    count_kernel[blocks](flat, thresholds, *common, counts, tiny, BLOCK=fused.BLOCK)
    running = torch.cumsum(counts, 0, dtype=torch.int32)
    indices = torch.empty(tables.slots, dtype=torch.int64, device=flat.device)
    values = torch.empty(tables.slots, dtype=flat.dtype, device=flat.device)
    keep_kernel[blocks](
        flat, thresholds, *common, counts, running, at["first_block"], at["ks"],
        at["slot_starts"], indices, values, tiny, BLOCK=fused.BLOCK,
    )  # fmt: skip
    pad_kernel[(math.ceil(tables.slots / fused.BLOCK),)](
        indices, values, at["slot_segment"], at["slot_starts"], at["ks"], counts, running,
        at["first_block"], at["last_block"], at["starts"], tables.slots, BLOCK=fused.BLOCK,
    )  # fmt: skip
    return indices, values

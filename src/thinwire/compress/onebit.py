"""1-bit SGD (Seide et al., 2014): one sign bit per value, one scale per sign group.

For a whole tensor (``per_row=False``, or a tensor too narrow for rows; per row below),
with error feedback already added to ``g`` (the default memory)::

    plus   = g >= 0                                   sign bits, packed 8 per byte
    a      = mean of g over plus                      scales, fp32; 0 for an empty group
    b      = mean of -g over not plus
    decode = a where plus, else -b
    mean   = (1/N) * sum over ranks of decode_r

Each sign group decodes to its own mean, so the decoded tensor keeps the sum of ``g``
and of each group (to fp32 rounding); what is lost is the spread inside each group, which
the residual carries to the next step. The scales differ between ranks, so payloads are
gathered and decoded one by one, each straight into the mean: a byte of signs indexes a
table of the 8 values it stands for, ``-b_r / N`` or ``a_r / N`` each
(:func:`~thinwire.compress.bits.decode`).
Wire: n/8 bytes of signs + 8 bytes of scales, 1.064 bits per value at n = 1000 and
1.0006 at n = 100 000.

Speed: the signs are found and packed, and the group sums taken, a chunk at a time
(cache-sized on the CPU, the whole tensor on a GPU: :func:`~thinwire.compress.bits.chunk_for`);
``mean`` and ``local`` are written into buffers kept from the tensor's last exchange
(:class:`~thinwire.compress.bits.OutputBuffers`), so on the CPU no full-size tensor is allocated.

With ``per_row`` (the default), every row (index of the first dimension: an output channel
of a convolution, an output unit of a linear layer) has its own pair ``(a_j, b_j)``, as
Seide et al. quantize column by column::

    a_j    = mean of g[j] over plus[j]             b_j = mean of -g[j] over not plus[j]
    decode = a_j where plus, else -b_j              in row j

Rows of very different magnitude no longer share one scale, for 8 more bytes per row:
1.028 bits per value for a 3x3 convolution of 256 input channels. Tensors whose rows hold
fewer than 64 values (:data:`~thinwire.compress.base.MIN_ROW`) keep one pair. Decoding
per row is a table lookup to ``t`` in {0, 1}, then ``t * a_j + (t - 1) * b_j``, a block
of rows at a time; one exchange of a 1024 x 4096 tensor in a world of one took 12 ms
against 7 ms with one pair (one thread).
"""

from __future__ import annotations

from collections.abc import Sequence
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
    check_floating,
    scaled_rows,
)
from thinwire.compress.bits import (
    OutputBuffers,
    ScratchBuffer,
    chunk_for,
    chunks,
    decode,
    pack,
    packed_size,
    unpack,
)
from thinwire.compress.registry import register_compressor
from thinwire.compress.segments import Segments, row_segments


@register_compressor
@dataclass
class OneBit(Compressor):
    """Signs plus the mean of each sign group; use with error feedback (the default).

    Options:
        per_row: one pair of scales per row (first dimension) of each tensor of two or
            more dimensions whose rows hold at least
            :data:`~thinwire.compress.base.MIN_ROW` values (the default);
            ``False``: one pair per tensor.
    """

    per_row: bool = True

    name = "onebit"
    summary = "1-bit SGD: signs 8 per byte + the mean of each sign group, gathered"
    aggregation = Aggregation.GATHER
    wants_error_feedback = True
    segmented = True
    large_segments_off_cpu = True

    def __post_init__(self) -> None:
        if not isinstance(self.per_row, bool):
            raise ValueError(f"per_row must be true or false, got {self.per_row!r}")
        self.buffers = OutputBuffers()
        self.block = ScratchBuffer()
        self._segments: dict[tuple[torch.Size, ...], Segments] = {}

    def exchange(self, tensor: Tensor, slot: Slot) -> Exchange:
        """Gather (signs, scales) from every rank and average their decodes."""
        check_floating(tensor)
        flat = tensor.reshape(-1)
        packed, scales = self._encode(flat, tensor.shape)
        local = decode_signs(packed, scales, self.buffers.take(slot.key, "local", flat), self.block)
        gathered = yield Request.gather(packed, scales)
        mean = self.buffers.take(slot.key, "mean", flat)
        for rank, (rank_packed, rank_scales) in enumerate(gathered):
            decode_signs(rank_packed, rank_scales / slot.world_size, mean, self.block, rank > 0)
        return Exchanged(mean=mean.view_as(tensor), local=local.view_as(tensor))

    def exchange_segmented(
        self, flat: Tensor, shapes: Sequence[torch.Size], slots: Sequence[Slot]
    ) -> Exchange:
        """:meth:`exchange` for small tensors side by side in ``flat``: each tensor, or
        each of its rows where :meth:`exchange` scales per row, is a segment with its own
        pair of scales; the signs of all of them are packed together."""
        check_floating(flat)
        segments = self._segments.get(tuple(shapes))
        if segments is None:
            segments = self._segments.setdefault(tuple(shapes), self._row_segments(shapes))
        plus = flat >= 0
        packed = pack(plus, 1)
        lengths = segments.counts(flat.device)
        wide = torch.float64 if flat.dtype == torch.float64 else torch.float32
        count = segments.sums(plus.to(wide))
        plus_sum = segments.sums(flat.clamp(min=0).to(wide))
        minus_sum = segments.sums(flat.clamp(max=0).to(wide)).neg_()
        a = plus_sum.double() / count.clamp_min(1)
        b = minus_sum.double() / (lengths - count).clamp_min(1)
        scales = torch.stack([a, b], 1).float()
        ones = plus.to(flat.dtype)
        local = _decode_segments(ones, scales.to(flat.dtype), segments)
        gathered = yield Request.gather(packed, scales)
        mean = torch.zeros_like(flat)
        for rank_packed, rank_scales in gathered:
            rank_ones = unpack(rank_packed, 1, flat.numel()).to(flat.dtype)
            scaled = (rank_scales / slots[0].world_size).to(flat.dtype)
            mean.add_(_decode_segments(rank_ones, scaled, segments))
        return Exchanged(mean=mean, local=local)

    def _row_segments(self, shapes: Sequence[torch.Size]) -> Segments:
        """One segment per row of each tensor scaled per row, else per tensor."""
        return row_segments(shapes, scaled_rows if self.per_row else lambda shape: None)

    def compress(self, tensor: Tensor, slot: Slot) -> tuple[list[Tensor], Any]:
        """Encode for inspection and tests: ``([packed signs, scales], numel)``; the scales
        are ``[a, b]``, or ``(rows, 2)`` when the tensor is scaled per row."""
        check_floating(tensor)
        return list(self._encode(tensor.reshape(-1), tensor.shape)), tensor.numel()

    def decompress(self, payload: Sequence[Tensor], ctx: Any) -> Tensor:
        """Decode one ``[packed signs, scales]`` payload of ``ctx`` values."""
        packed, scales = payload
        return decode_signs(packed, scales, scales.new_empty(ctx), self.block)

    def _encode(self, flat: Tensor, shape: torch.Size) -> tuple[Tensor, Tensor]:
        """Signs and scales of the flattened tensor ``flat`` of ``shape``: per row with
        ``per_row``, when its rows are long enough
        (:func:`~thinwire.compress.base.scaled_rows`)."""
        rows = scaled_rows(shape) if self.per_row else None
        if rows is not None:
            return encode_rows(flat.view(rows, -1))
        return encode(flat)


def encode(flat: Tensor) -> tuple[Tensor, Tensor]:
    """The sign bits ``flat >= 0``, packed, and the fp32 scales ``[a, b]`` (means of ``g``
    over the plus group and of ``-g`` over the rest), a chunk at a time."""
    numel = flat.numel()
    packed = torch.empty(packed_size(numel, 1), dtype=torch.uint8, device=flat.device)
    count = torch.zeros((), dtype=torch.int64, device=flat.device)
    sums = torch.zeros(2, dtype=torch.float64, device=flat.device)  # of g over plus, -g
    chunk = chunk_for(flat.device)
    size = min(numel, chunk)
    signs = torch.empty(size, dtype=torch.bool, device=flat.device)
    work = torch.empty(size, dtype=flat.dtype, device=flat.device)
    wide = torch.float64 if flat.dtype == torch.float64 else torch.float32  # to sum in
    for part in chunks(numel, chunk):
        x, n = flat[part], part.stop - part.start
        plus = torch.ge(x, 0, out=signs[:n])
        pack(plus, 1, out=packed[part.start // 8 : packed_size(part.stop, 1)])
        count += torch.count_nonzero(plus)
        plus_sum = torch.clamp(x, min=0, out=work[:n]).sum(dtype=wide)
        minus_sum = torch.clamp(x, max=0, out=work[:n]).sum(dtype=wide)
        sums += torch.stack([plus_sum, minus_sum.neg()]).double()
    counts = torch.stack([count, numel - count]).clamp_min_(1)
    return packed, (sums / counts).float()


def encode_rows(matrix: Tensor) -> tuple[Tensor, Tensor]:
    """The sign bits of a ``(rows, cols)`` matrix, packed row after row, and the
    fp32 scales ``(rows, 2)``: ``[a_j, b_j]`` of each row, a block of rows at a time."""
    rows, cols = matrix.shape
    wide = torch.float64 if matrix.dtype == torch.float64 else torch.float32
    packed = torch.empty(packed_size(rows * cols, 1), dtype=torch.uint8, device=matrix.device)
    counts = torch.empty(rows, dtype=torch.int64, device=matrix.device)
    sums = torch.empty(rows, 2, dtype=torch.float64, device=matrix.device)
    step = _rows_per_block(cols, matrix.device)
    for lo in range(0, rows, step):
        hi = min(rows, lo + step)
        block = matrix[lo:hi]
        plus = block >= 0
        pack(plus.reshape(-1), 1, out=packed[lo * cols // 8 : packed_size(hi * cols, 1)])
        counts[lo:hi] = plus.sum(1)
        sums[lo:hi, 0] = block.clamp(min=0).sum(1, dtype=wide)
        sums[lo:hi, 1] = block.clamp(max=0).sum(1, dtype=wide).neg()
    members = torch.stack([counts, cols - counts], 1).clamp_min_(1)
    return packed, (sums / members).float()


def decode_signs(
    packed: Tensor,
    scales: Tensor,
    out: Tensor,
    block: ScratchBuffer | None = None,
    add: bool = False,
) -> Tensor:
    """``a`` where the packed sign bit is set, ``-b`` elsewhere, written into (with ``add``,
    added to) the contiguous ``out``, which is returned.

    Scales of shape ``(rows, 2)`` give each row of ``out`` its own ``[a_j, b_j]``: a block
    of rows at a time, the bits become ``t`` in {0, 1} (a table lookup), then
    ``out = t * a_j + (t - 1) * b_j``. One of the two terms is always 0, so each value is
    exactly ``a_j`` or ``-b_j`` (``-b + t * (a + b)`` would round). ``block`` keeps the
    block of ``t`` from one call to the next.
    """
    if scales.dim() == 1:
        a, b = scales
        return decode(packed, 1, torch.stack([-b, a]), out=out.view(-1), add=add)
    rows = scales.shape[0]
    matrix = out.view(rows, -1)
    cols = matrix.shape[1]
    a, b = (scale.unsqueeze(1) for scale in scales.to(out.dtype).unbind(1))
    step = _rows_per_block(cols, out.device)
    bits = torch.arange(2, dtype=out.dtype, device=out.device)  # no copy from the host
    block = block if block is not None else ScratchBuffer()
    for lo in range(0, rows, step):
        hi = min(rows, lo + step)
        plus = block.take((hi - lo) * cols, out.dtype, out.device).view(hi - lo, cols)
        decode(packed[lo * cols // 8 : packed_size(hi * cols, 1)], 1, bits, out=plus.view(-1))
        part = matrix[lo:hi]
        if add:
            part.addcmul_(plus, a[lo:hi])
        else:
            torch.mul(plus, a[lo:hi], out=part)
        part.addcmul_(plus.sub_(1), b[lo:hi])
    return out


def _decode_segments(ones: Tensor, scales: Tensor, segments: Segments) -> Tensor:
    """``a`` of its segment where ``ones`` is 1, ``-b`` where it is 0: ``t * a + (t - 1) *
    b``, one of whose terms is always 0, so each value is exactly ``a`` or ``-b``."""
    a, b = (segments.expand(column) for column in scales.unbind(1))
    return ones * a + (ones - 1) * b


def _rows_per_block(cols: int, device: torch.device) -> int:
    """Rows per block of :func:`encode_rows` and :func:`decode_signs`: about
    :func:`~thinwire.compress.bits.chunk_for` values, a multiple of 8 rows so that every
    block starts at a whole byte of signs."""
    return max(1, chunk_for(device) // max(cols, 1) // 8) * 8

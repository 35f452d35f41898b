"""1-bit SGD (Seide et al., 2014): one sign bit per value, one scale per sign group.

With error feedback already added to ``g`` (the default memory)::

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

Speed: the signs are found and packed, and the group sums taken, a cache-sized chunk at a
time; ``mean`` and ``local`` are written into buffers kept from the tensor's last exchange
(:class:`~thinwire.compress.bits.OutputBuffers`), so no full-size tensor is allocated.
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
)
from thinwire.compress.bits import CHUNK, OutputBuffers, chunks, decode, pack, packed_size
from thinwire.compress.registry import register_compressor


@register_compressor
@dataclass
class OneBit(Compressor):
    """Signs plus the mean of each sign group; use with error feedback (the default)."""

    name = "onebit"
    summary = "1-bit SGD: signs 8 per byte + the mean of each sign group, gathered"
    aggregation = Aggregation.GATHER
    wants_error_feedback = True

    def __post_init__(self) -> None:
        self.buffers = OutputBuffers()

    def exchange(self, tensor: Tensor, slot: Slot) -> Exchange:
        """Gather (signs, scales) from every rank and average their decodes."""
        check_floating(tensor)
        flat = tensor.reshape(-1)
        packed, scales = encode(flat)
        local = decode_signs(packed, scales, out=self.buffers.take(slot.key, "local", flat))
        gathered = yield Request.gather(packed, scales)
        mean = self.buffers.take(slot.key, "mean", flat)
        for rank, (rank_packed, rank_scales) in enumerate(gathered):
            decode_signs(rank_packed, rank_scales / slot.world_size, out=mean, add=rank > 0)
        return Exchanged(mean=mean.view_as(tensor), local=local.view_as(tensor))

    def compress(self, tensor: Tensor, slot: Slot) -> tuple[list[Tensor], Any]:
        """Encode for inspection and tests: ``([packed signs, scales], numel)``."""
        check_floating(tensor)
        flat = tensor.reshape(-1)
        return list(encode(flat)), flat.numel()

    def decompress(self, payload: Sequence[Tensor], ctx: Any) -> Tensor:
        """Decode one ``[packed signs, scales]`` payload of ``ctx`` values."""
        packed, scales = payload
        return decode_signs(packed, scales, out=scales.new_empty(ctx))


def encode(flat: Tensor) -> tuple[Tensor, Tensor]:
    """The sign bits ``flat >= 0``, packed, and the fp32 scales ``[a, b]`` (means of ``g``
    over the plus group and of ``-g`` over the rest), a chunk at a time."""
    numel = flat.numel()
    packed = torch.empty(packed_size(numel, 1), dtype=torch.uint8, device=flat.device)
    count = torch.zeros((), dtype=torch.int64, device=flat.device)
    sums = torch.zeros(2, dtype=torch.float64, device=flat.device)  # of g over plus, -g
    size = min(numel, CHUNK)
    signs = torch.empty(size, dtype=torch.bool, device=flat.device)
    work = torch.empty(size, dtype=flat.dtype, device=flat.device)
    wide = torch.float64 if flat.dtype == torch.float64 else torch.float32  # to sum in
    for part in chunks(numel):
        x, n = flat[part], part.stop - part.start
        plus = torch.ge(x, 0, out=signs[:n])
        pack(plus, 1, out=packed[part.start // 8 : packed_size(part.stop, 1)])
        count += torch.count_nonzero(plus)
        plus_sum = torch.clamp(x, min=0, out=work[:n]).sum(dtype=wide)
        minus_sum = torch.clamp(x, max=0, out=work[:n]).sum(dtype=wide)
        sums += torch.stack([plus_sum, minus_sum.neg()]).double()
    counts = torch.stack([count, numel - count]).clamp_min_(1)
    return packed, (sums / counts).float()


def decode_signs(packed: Tensor, scales: Tensor, out: Tensor, add: bool = False) -> Tensor:
    """``a`` where the packed sign bit is set, ``-b`` elsewhere, written into (with ``add``,
    added to) the 1-D ``out``."""
    a, b = scales
    return decode(packed, 1, torch.stack([-b, a]), out=out.view(-1), add=add)

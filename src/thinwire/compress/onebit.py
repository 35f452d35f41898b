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
gathered and decoded one by one. Wire: n/8 bytes of signs + 8 bytes of scales, 1.064 bits
per value at n = 1000 and 1.0006 at n = 100 000.
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
from thinwire.compress.bits import pack, unpack
from thinwire.compress.registry import register_compressor


@register_compressor
@dataclass
class OneBit(Compressor):
    """Signs plus the mean of each sign group; use with error feedback (the default)."""

    name = "onebit"
    summary = "1-bit SGD: signs 8 per byte + the mean of each sign group, gathered"
    aggregation = Aggregation.GATHER
    wants_error_feedback = True

    def exchange(self, tensor: Tensor, slot: Slot) -> Exchange:
        """Gather (signs, scales) from every rank and average their decodes."""
        check_floating(tensor)
        flat = tensor.reshape(-1)
        local = torch.empty_like(flat)
        plus, scales = encode(flat, work=local)
        decode(plus, scales, out=local)
        gathered = yield Request.gather(pack(plus, 1), scales)
        mean, decoded = torch.zeros_like(flat), torch.empty_like(flat)
        for packed, rank_scales in gathered:
            mean.add_(decode(unpack_signs(packed, flat.numel()), rank_scales, out=decoded))
        mean.div_(slot.world_size)
        return Exchanged(mean=mean.view_as(tensor), local=local.view_as(tensor))

    def compress(self, tensor: Tensor, slot: Slot) -> tuple[list[Tensor], Any]:
        """Encode for inspection and tests: ``([packed signs, scales], numel)``."""
        check_floating(tensor)
        flat = tensor.reshape(-1)
        plus, scales = encode(flat, work=torch.empty_like(flat))
        return [pack(plus, 1), scales], flat.numel()

    def decompress(self, payload: Sequence[Tensor], ctx: Any) -> Tensor:
        """Decode one ``[packed signs, scales]`` payload of ``ctx`` values."""
        packed, scales = payload
        return decode(unpack_signs(packed, ctx), scales, out=scales.new_empty(ctx))


def encode(flat: Tensor, work: Tensor) -> tuple[Tensor, Tensor]:
    """The sign mask ``flat >= 0`` and the fp32 scales ``[a, b]`` (means of ``g`` over the
    plus group and of ``-g`` over the rest); ``work`` is scratch of ``flat``'s size."""
    plus = flat >= 0
    count = plus.sum()
    counts = torch.stack([count, flat.numel() - count]).clamp_min_(1)
    plus_sum = torch.clamp(flat, min=0, out=work).sum()
    minus_sum = torch.clamp(flat, max=0, out=work).sum().neg()
    return plus, torch.stack([plus_sum, minus_sum]).float() / counts


def decode(plus: Tensor, scales: Tensor, out: Tensor) -> Tensor:
    """``a`` where the bool mask ``plus`` is set, ``-b`` elsewhere, written into ``out``."""
    a, b = scales.to(out.dtype)
    return torch.where(plus, a, -b, out=out)


def unpack_signs(packed: Tensor, count: int) -> Tensor:
    """The bool mask of ``count`` packed sign bits (unpacked bytes are 0 or 1: a free view)."""
    return unpack(packed, 1, count).view(torch.bool)

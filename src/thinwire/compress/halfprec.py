"""Half-precision all-reduce, shared by fp16 and bf16: cast, sum, cast back.

    payload = half(g / N)              pre-divided, so the sum of N payloads is one gradient
    mean    = float(sum over ranks of payload)
    local   = float(payload) * N       this rank's contribution, in the gradient's units

Dividing before the cast keeps the sum in range: N payloads of a gradient near the half
type's largest value add up to about that value, not N times it. Rounding to nearest costs
a relative error of at most 2**-11 (fp16, 11 significant bits) or 2**-8 (bf16, 8 bits)
per value, plus the rounding of the half-precision sum. fp16 also has a narrow range:
``|g| / N`` above 65504 becomes infinite and below 2**-14 loses bits; bf16 has fp32's range.
Half the bytes of fp32 and summable, so it rides a plain ring all-reduce.
"""

from __future__ import annotations

from typing import ClassVar

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


class HalfPrecision(Compressor):
    """Base of the half-precision compressors: subclasses set ``dtype`` (and a name)."""

    #: the payload's dtype (torch.float16 or torch.bfloat16)
    dtype: ClassVar[torch.dtype]

    aggregation = Aggregation.SUM
    stateless = True
    elementwise = True
    transparent = True  # NaN and infinity survive the division and the cast

    def exchange(self, tensor: Tensor, slot: Slot) -> Exchange:
        """Sum ``tensor / N`` in half precision over ranks; the sum is the mean."""
        check_floating(tensor)
        # The division runs in the tensor's precision; only its result is rounded to half.
        payload = torch.div(tensor, slot.world_size, out=torch.empty_like(tensor, dtype=self.dtype))
        local = payload.to(tensor.dtype).mul_(slot.world_size)
        (summed,) = yield Request.sum(payload, scratch=True)
        return Exchanged(mean=summed.to(tensor.dtype, copy=True), local=local)

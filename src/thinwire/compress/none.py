"""No compression: the averaged gradient, exactly as DDP's own all-reduce computes it.

payload = g / N        (pre-divided, like DDP, so the sum is the mean)
mean    = sum over ranks of payload
"""

from __future__ import annotations

from torch import Tensor

from thinwire.compress.base import Aggregation, Compressor, Exchange, Exchanged, Request, Slot
from thinwire.compress.registry import register_compressor


@register_compressor
class NoCompression(Compressor):
    """Dense fp32 all-reduce; the reference every compressor is measured against."""

    name = "none"
    summary = "no compression: dense fp32 all-reduce, bitwise equal to DDP's own"
    aggregation = Aggregation.SUM
    stateless = True
    elementwise = True
    transparent = True

    def exchange(self, tensor: Tensor, slot: Slot) -> Exchange:
        """Sum ``tensor / N`` over ranks (summed in place: the quotient is a new tensor)."""
        (mean,) = yield Request.sum(tensor.div(slot.world_size), scratch=True)
        return Exchanged(mean=mean, local=tensor)

"""fp16 all-reduce: ``half(g / N)`` summed over ranks (see :mod:`thinwire.compress.halfprec`).

16 bits per value; relative rounding at most 2**-11 for ``|g| / N`` in [2**-14, 65504].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from thinwire.compress.halfprec import HalfPrecision
from thinwire.compress.registry import register_compressor


@register_compressor
@dataclass
class FP16(HalfPrecision):
    """IEEE half precision (11 significant bits, largest value 65504); no options."""

    name = "fp16"
    summary = "fp16 all-reduce: gradients pre-divided by N, cast to half, summed"
    dtype = torch.float16

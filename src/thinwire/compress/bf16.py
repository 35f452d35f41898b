"""bf16 all-reduce: ``bfloat16(g / N)`` summed over ranks (see
:mod:`thinwire.compress.halfprec`).

16 bits per value; fp32's exponent range, relative rounding at most 2**-8.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from thinwire.compress.halfprec import HalfPrecision
from thinwire.compress.registry import register_compressor


@register_compressor
@dataclass
class BF16(HalfPrecision):
    """bfloat16 (8 significant bits, fp32's range: no overflow); no options."""

    name = "bf16"
    summary = "bf16 all-reduce: gradients pre-divided by N, cast to bfloat16, summed"
    dtype = torch.bfloat16

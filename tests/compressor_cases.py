"""What the compressor tests share: small tensors, a slot, bits on the wire, ranks by hand."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from hypothesis import strategies as st
from torch import Tensor

from thinwire.compress import Slot, run_locally
from thinwire.compress.base import Compressor, Exchange, Exchanged
from thinwire.compress.simulated import drive_ranks

SLOT = Slot("w", 0, 1)

#: Small fp32 tensors with zeros, ties and a wide spread of magnitudes (no subnormals:
#: their group means and norms underflow, which says nothing about the algorithms).
small_tensors = st.lists(
    st.floats(-100, 100, width=32, allow_subnormal=False) | st.sampled_from([0.0, -0.0, 1.0, -1.0]),
    min_size=1,
    max_size=24,
).map(lambda values: torch.tensor(values, dtype=torch.float32))


def randn(*shape: int, seed: int = 0) -> Tensor:
    """A reproducible standard normal tensor."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def bits_per_value(compressor: Compressor, x: Tensor) -> float:
    """Bits this rank puts on the wire per value of ``x``, over every round."""
    wire: list[int] = []
    run_locally(compressor.exchange(x, SLOT), wire)
    return 8 * sum(wire) / x.numel()


def drive(protocols: Sequence[Exchange]) -> list[Exchanged]:
    """Run one protocol per rank in lock-step, answering each round like a communicator
    (a sum in the payload's dtype, a maximum, or every rank's tensors); every rank gets its
    own copy of the answer."""
    return drive_ranks(protocols)[0]

"""Top-k sparsification: send the ``k = density * n`` entries of largest magnitude.

    idx    = argtop_k |g|
    send     (g[idx], idx)           fp32 values + int32 indices: 64 bits per kept entry
    mean   = (1/N) * sum over ranks of scatter(values_r at idx_r)

Indices differ between ranks, so payloads are gathered, not summed. Use with error
feedback (the default): the dropped entries wait in the residual.
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
    check_fraction,
    num_selected,
)
from thinwire.compress.registry import register_compressor


@register_compressor
@dataclass
class TopK(Compressor):
    """Exact top-k by magnitude (``torch.topk``).

    Options:
        density: fraction of entries kept, in (0, 1].
    """

    density: float = 0.01

    name = "topk"
    summary = "top-k sparsification by magnitude (exact), values + int32 indices, gathered"
    aggregation = Aggregation.GATHER
    wants_error_feedback = True

    def __post_init__(self) -> None:
        self.density = check_fraction("density", self.density)

    def compresses(self, tensor: Tensor) -> bool:
        """Tensors of one dimension (biases, norms) go dense."""
        return tensor.dim() > 1

    def select(self, flat: Tensor, k: int, slot: Slot) -> Tensor:
        """Flat indices of the ``k`` entries of ``flat`` with largest magnitude."""
        return torch.topk(flat.abs(), k, sorted=False).indices

    def exchange(self, tensor: Tensor, slot: Slot) -> Exchange:
        """Gather (values, indices) from every rank and scatter-add them."""
        flat = tensor.reshape(-1)
        k = num_selected(flat.numel(), self.density_at(slot))
        indices = self.select(flat, k, slot)
        values = flat.index_select(0, indices)
        gathered = yield Request.gather(values, indices.to(torch.int32))
        mean = torch.zeros_like(flat)
        for rank_values, rank_indices in gathered:
            mean.index_add_(0, rank_indices.long(), rank_values)
        mean.div_(slot.world_size)
        return Exchanged(mean=mean.view_as(tensor), local=None, sent_indices=indices)

    def density_at(self, slot: Slot) -> float:
        """The density used at ``slot.step`` (constant here; DGC warms up)."""
        return self.density

    def decompress(self, payload: Sequence[Tensor], ctx: Any) -> Tensor:
        """Scatter one (values, indices) payload into a dense tensor of ``ctx`` numel."""
        values, indices = payload
        out = torch.zeros(ctx, dtype=values.dtype, device=values.device)
        return out.index_put_((indices.long(),), values)

    def compress(self, tensor: Tensor, slot: Slot) -> tuple[list[Tensor], Any]:
        """Encode for inspection and tests: ``([values, int32 indices], numel)``."""
        flat = tensor.reshape(-1)
        indices = self.select(flat, num_selected(flat.numel(), self.density_at(slot)), slot)
        return [flat.index_select(0, indices), indices.to(torch.int32)], flat.numel()

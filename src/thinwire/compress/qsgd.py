"""QSGD (Alistarh et al., NeurIPS 2017): stochastic rounding of |g| / ||g|| to s levels.

    norm   = ||g||_2                                   one fp32 per tensor
    l      = floor(|g| / norm * s + u),  u ~ U[0, 1)   so E[l] = |g| / norm * s
    code   = sign(g) * l + s                           in [0, 2s]
    decode = norm / s * (code - s)
    mean   = (1/N) * sum over ranks of decode_r

E[decode] = g: unbiased, so no error feedback by default; each entry's variance is at
most (norm / s)² / 4. u comes from the compressor's own generator, one stream per rank
(:mod:`thinwire.compress.stochastic`). Codes are packed with the fewest of 2, 4 or 8 bits
that hold 2s + 1 values: s = 1 takes 2 bits, s <= 7 takes 4, s <= 127 takes 8. Norms
differ between ranks, so payloads are gathered. Wire at the default s = 7: n/2 bytes +
4 bytes of norm, 4.032 bits per value at n = 1000.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from thinwire.compress.base import (
    Aggregation,
    Exchange,
    Exchanged,
    Request,
    Slot,
    check_floating,
    check_positive_int,
)
from thinwire.compress.bits import SUPPORTED_BITS, pack, unpack
from thinwire.compress.registry import register_compressor
from thinwire.compress.segments import Segments, tensor_segments
from thinwire.compress.stochastic import RankStream, StochasticCompressor, check_seed, l2_norm

#: The most levels whose 2s + 1 codes fit in one byte.
MAX_LEVELS = 127


@register_compressor
@dataclass
class QSGD(StochasticCompressor):
    """Unbiased stochastic quantisation to ``levels`` magnitudes per sign, scaled by the norm.

    Options:
        levels: the number s of non-zero magnitudes, an integer in [1, 127].
        seed: seeds each rank's random stream, together with the rank.
    """

    levels: int = 7
    seed: int = 0

    name = "qsgd"
    summary = "QSGD: unbiased stochastic rounding to s levels of |g|/||g||, 2-8 bits, gathered"
    aggregation = Aggregation.GATHER
    segmented = True
    large_segments_off_cpu = True

    def __post_init__(self) -> None:
        self.levels = check_positive_int("levels", self.levels)
        if self.levels > MAX_LEVELS:
            raise ValueError(
                f"levels must be at most {MAX_LEVELS} (2 * levels + 1 codes must fit in a "
                f"byte), got {self.levels!r}"
            )
        self.seed = check_seed(self.seed)
        #: bits per code: the fewest that hold the 2s + 1 codes
        self.bits = next(b for b in SUPPORTED_BITS if b > 1 and 2**b > 2 * self.levels)
        self.random = RankStream(self.seed, self.name)
        self._segments: dict[tuple[torch.Size, ...], Segments] = {}

    def exchange(self, tensor: Tensor, slot: Slot) -> Exchange:
        """Gather (codes, norm) from every rank and average their decodes."""
        check_floating(tensor)
        flat = tensor.reshape(-1)
        local = torch.empty_like(flat)
        packed, norm = self.encode(flat, slot, local=local)
        gathered = yield Request.gather(packed, norm)
        mean, levels = torch.zeros_like(flat), torch.empty_like(flat)
        for rank_packed, rank_norm in gathered:
            self.unpack_levels(rank_packed, out=levels)
            mean.addcmul_(levels, rank_norm.to(flat.dtype) / self.levels)
        mean.div_(slot.world_size)
        return Exchanged(mean=mean.view_as(tensor), local=local.view_as(tensor))

    def exchange_segmented(
        self, flat: Tensor, shapes: Sequence[torch.Size], slots: Sequence[Slot]
    ) -> Exchange:
        """:meth:`exchange` for small tensors side by side in ``flat``: one norm per tensor
        (a segment), all codes packed together, one draw from the stream for them all."""
        check_floating(flat)
        segments = self._segments.get(tuple(shapes))
        if segments is None:
            segments = self._segments.setdefault(tuple(shapes), tensor_segments(shapes))
        s = self.levels
        norms = segments.sums(flat.double().square()).sqrt_().float()
        norm = segments.expand(norms.to(flat.dtype))
        local = self.random.uniform_(torch.empty_like(flat), slots[0])
        levels = flat.abs().div_(torch.where(norm > 0, norm, 1.0)).mul_(s)
        levels.add_(local).floor_().clamp_(max=s).copysign_(flat)
        torch.mul(levels, norm / s, out=local)
        gathered = yield Request.gather(pack(levels.add_(s), self.bits), norms)
        mean = torch.zeros_like(flat)
        for rank_packed, rank_norms in gathered:
            self.unpack_levels(rank_packed, out=levels)
            mean.addcmul_(levels, segments.expand((rank_norms / s).to(flat.dtype)))
        mean.div_(slots[0].world_size)
        return Exchanged(mean=mean, local=local)

    def encode(self, flat: Tensor, slot: Slot, local: Tensor) -> tuple[Tensor, Tensor]:
        """Packed codes and the fp32 norm of ``flat``; writes the decode into ``local``."""
        s = self.levels
        norm = l2_norm(flat).reshape(1)
        levels = flat.abs().div_(torch.where(norm > 0, norm, 1.0).to(flat.dtype)).mul_(s)
        levels.add_(self.random.uniform_(local, slot)).floor_()
        levels.clamp_(max=s).copysign_(flat)  # |g| <= norm, unless rounding says otherwise
        torch.mul(levels, norm.to(flat.dtype) / s, out=local)
        return pack(levels.add_(s), self.bits), norm

    def unpack_levels(self, packed: Tensor, out: Tensor) -> Tensor:
        """The signed levels ``code - s`` of one payload, written into ``out``."""
        return out.copy_(unpack(packed, self.bits, out.numel())).sub_(self.levels)

    def compress(self, tensor: Tensor, slot: Slot) -> tuple[list[Tensor], Any]:
        """Encode for inspection and tests (draws from the stream): ``([codes, norm], numel)``."""
        check_floating(tensor)
        flat = tensor.reshape(-1)
        packed, norm = self.encode(flat, slot, local=torch.empty_like(flat))
        return [packed, norm], flat.numel()

    def decompress(self, payload: Sequence[Tensor], ctx: Any) -> Tensor:
        """Decode one ``[codes, norm]`` payload of ``ctx`` values."""
        packed, norm = payload
        return self.unpack_levels(packed, out=norm.new_empty(ctx)).mul_(norm / self.levels)

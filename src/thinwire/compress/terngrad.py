"""TernGrad (Wen et al., NeurIPS 2017): unbiased ternary gradients, 2 bits per value.

    c      = clamp(g, ±clip_sigma * σ)             σ = sqrt(mean g²), see below
    s      = max over ranks of max |c|             round 1: a max all-reduce of one number
    t      = sign(c) * b,  b ~ Bernoulli(|c| / s)  t in {-1, 0, +1}, sent as t + 1 in 2 bits
    mean   = s * (1/N) * sum over ranks of t_r     round 2: gather the codes
    local  = s * t

E[s t] = c: unbiased for the clipped tensor, so no error feedback by default. Sharing s
makes every rank's ternaries worth the same, and clipping the rare large entries keeps s
small, so fewer entries round to zero. σ is the spread about zero (the root mean square),
which equals the paper's standard deviation for the zero-mean gradients it has in mind;
the deviation about the mean would clip a tensor of nearly equal entries down to almost
nothing. ``b`` is drawn as ``u * s < |c|`` with u ~ U[0, 1) from the compressor's own
generator (:mod:`thinwire.compress.stochastic`), which needs no division (s = 0 sends 0).
Wire: 4 bytes in round 1 + n/4 bytes in round 2, 2.032 bits per value at n = 1000.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from thinwire.compress.base import (
    Aggregation,
    Exchange,
    Exchanged,
    Request,
    Slot,
    check_floating,
)
from thinwire.compress.bits import pack, unpack
from thinwire.compress.registry import register_compressor
from thinwire.compress.stochastic import RankStream, StochasticCompressor, check_seed, l2_norm


@register_compressor
@dataclass
class TernGrad(StochasticCompressor):
    """Stochastic ternary quantisation with a scaler shared by a max all-reduce.

    Options:
        clip_sigma: clip entries to ``clip_sigma`` root-mean-squares of the tensor before
            quantising (> 0); ``None`` disables clipping.
        seed: seeds each rank's random stream, together with the rank.
    """

    clip_sigma: float | None = 2.5
    seed: int = 0

    name = "terngrad"
    summary = "TernGrad: unbiased stochastic ternary, 2 bits per value, max-shared scaler"
    aggregation = Aggregation.GATHER

    def __post_init__(self) -> None:
        sigma = self.clip_sigma
        if sigma is not None:
            if isinstance(sigma, bool) or not isinstance(sigma, (int, float)) or not sigma > 0:
                raise ValueError(f"clip_sigma must be a number > 0 or None, got {sigma!r}")
            self.clip_sigma = float(sigma)
        self.seed = check_seed(self.seed)
        self.random = RankStream(self.seed, self.name)

    def exchange(self, tensor: Tensor, slot: Slot) -> Exchange:
        """Share the scaler by a max all-reduce, then gather the ternary codes."""
        check_floating(tensor)
        flat = tensor.reshape(-1)
        local = torch.empty_like(flat)  # holds the clipped tensor, later s * t
        clipped = self.clip(flat, out=local)
        (s,) = yield Request.max(peak_magnitude(clipped).reshape(1))
        threshold = self.random.uniform_(torch.empty_like(flat), slot).mul_(s)  # u * s
        codes = (clipped > threshold).to(torch.uint8).add_(1)  # +1 -> 2, 0 -> 1
        codes.sub_((clipped < threshold.neg_()).to(torch.uint8))  # -1 -> 0
        gathered = yield Request.gather(pack(codes, 2))
        mean = torch.zeros_like(flat)
        for (packed,) in gathered:
            mean.add_(unpack(packed, 2, flat.numel()))  # sum of t_r + 1
        world = slot.world_size
        mean.sub_(world).mul_(s.to(flat.dtype) / world)
        local.copy_(codes).sub_(1).mul_(s.to(flat.dtype))
        return Exchanged(mean=mean.view_as(tensor), local=local.view_as(tensor))

    def clip(self, flat: Tensor, out: Tensor) -> Tensor:
        """``flat`` clamped to ``±clip_sigma * sqrt(mean(flat²))`` in ``out``, or ``flat``
        itself when clipping is off."""
        if self.clip_sigma is None:
            return flat
        rms = l2_norm(flat) / math.sqrt(max(flat.numel(), 1))
        bound = rms * self.clip_sigma
        return torch.clamp(flat, min=-bound, max=bound, out=out)


def peak_magnitude(flat: Tensor) -> Tensor:
    """``max |flat|`` as a 0-d fp32 tensor (0 for an empty tensor), in one pass."""
    if flat.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=flat.device)
    low, high = torch.aminmax(flat)
    return torch.maximum(high, low.neg()).float()

"""TernGrad (Wen et al., NeurIPS 2017): unbiased ternary gradients, 2 bits per value.

    c      = clamp(g, ±clip_sigma * σ)             σ = sqrt(mean g²), see below
    s      = max over ranks of max |c|             round 1: a max all-reduce of one number
    t      = round(c / s + v),  v ~ U(-1/2, 1/2)   t in {-1, 0, +1}, sent as t + 1 in 2 bits
    mean   = (1/N) * sum over ranks of s * t_r     round 2: gather the codes
    local  = s * t

Rounding ``c / s`` (in [-1, 1]) after adding uniform noise is the paper's
``sign(c) * b, b ~ Bernoulli(|c| / s)``: t = sign(c) with probability |c| / s, else 0, so
E[s t] = c: unbiased for the clipped tensor, and no error feedback by default. Sharing s
makes every rank's ternaries worth the same, and clipping the rare large entries keeps s
small, so fewer entries round to zero. σ is the spread about zero (the root mean square),
which equals the paper's standard deviation for the zero-mean gradients it has in mind;
the deviation about the mean would clip a tensor of nearly equal entries down to almost
nothing. Wire: 4 bytes in round 1 + n/4 bytes in round 2, 2.032 bits per value at n = 1000.

``v`` comes from the compressor's own generator (:mod:`thinwire.compress.stochastic`),
15 random bits per entry, four entries per 64-bit draw: v is an odd multiple of 2^-16, so
P(t = sign c) is |c| / s to within 2^-16, a zero always sends 0 and an entry at ±s always
sends ±1.

The above is the paper's form, one scaler per layer (``per_row=False``). By default
(``per_row``) every row (first dimension: an output channel or unit, or one gate's unit of
an LSTM's stacked matrix) of a tensor whose rows hold at least 64 values has its own bound
and scaler::

    c[j]   = clamp(g[j], ±clip_sigma * σ_j)        σ_j = sqrt(mean g[j]²)
    s_j    = max over ranks of max |c[j]|           round 1: a max all-reduce of a vector
    t[j]   = round(c[j] / s_j + v)                  mean = s_j * (1/N) * sum of t_r[j]

A row of small gradients no longer rounds to zero against a large row's scaler, for 4
more bytes per row in round 1 (2.06 bits per value at 512 values a row).

The codes are made a chunk at a time (:func:`ternary_codes`; cache-sized on the CPU, the
whole tensor on a GPU), and
every payload is decoded straight into the mean through a table of the values of each pair
of code bytes (:func:`~thinwire.compress.bits.decode`); ``mean`` and ``local`` are written
into buffers kept from the tensor's last exchange, so no full-size tensor is allocated.
"""

from __future__ import annotations

import math
from collections.abc import Generator, Sequence
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
    scaled_rows,
)
from thinwire.compress.bits import (
    OutputBuffers,
    chunk_for,
    chunks,
    decode,
    pack,
    packed_size,
    unpack,
)
from thinwire.compress.registry import register_compressor
from thinwire.compress.segments import Segments, row_segments
from thinwire.compress.stochastic import RankStream, StochasticCompressor, check_seed, l2_norm

#: t for each 2-bit code t + 1 (code 3 is never sent)
TERNARY = (-1.0, 0.0, 1.0, 0.0)
_TERNARY_ON: dict[torch.device, Tensor] = {}


def ternary_values(device: torch.device) -> Tensor:
    """:data:`TERNARY` as a tensor on ``device``, copied there once (on a GPU each copy
    from the host would make the host wait)."""
    values = _TERNARY_ON.get(device)
    if values is None:
        values = _TERNARY_ON.setdefault(device, torch.tensor(TERNARY, device=device))
    return values


@register_compressor
@dataclass
class TernGrad(StochasticCompressor):
    """Stochastic ternary quantisation with a scaler shared by a max all-reduce.

    Options:
        clip_sigma: clip entries to ``clip_sigma`` root-mean-squares of the tensor before
            quantising (> 0); ``None`` disables clipping.
        seed: seeds each rank's random stream, together with the rank.
        per_row: a bound and a scaler per row (first dimension) of each tensor whose rows
            hold at least :data:`~thinwire.compress.base.MIN_ROW` values (the default);
            ``False``: one per tensor, as published, which ended 6.9 % above dense's
            perplexity on a small LSTM against 1.4 % per row (docs/measurements.md, "Quality").
    """

    clip_sigma: float | None = 2.5
    seed: int = 0
    per_row: bool = True

    name = "terngrad"
    summary = "TernGrad: unbiased stochastic ternary, 2 bits per value, max-shared scaler"
    aggregation = Aggregation.GATHER
    segmented = True
    large_segments_off_cpu = True

    def __post_init__(self) -> None:
        sigma = self.clip_sigma
        if sigma is not None:
            if isinstance(sigma, bool) or not isinstance(sigma, (int, float)) or not sigma > 0:
                raise ValueError(f"clip_sigma must be a number > 0 or None, got {sigma!r}")
            self.clip_sigma = float(sigma)
        self.seed = check_seed(self.seed)
        if not isinstance(self.per_row, bool):
            raise ValueError(f"per_row must be true or false, got {self.per_row!r}")
        self.random = RankStream(self.seed, self.name)
        self.buffers = OutputBuffers()
        self._segments: dict[tuple[torch.Size, ...], Segments] = {}

    def exchange(self, tensor: Tensor, slot: Slot) -> Exchange:
        """Share the scaler by a max all-reduce, then gather the ternary codes."""
        check_floating(tensor)
        flat = tensor.reshape(-1)
        rows = scaled_rows(tensor.shape) if self.per_row else None
        if rows is not None:
            mean, local = yield from self._exchange_rows(flat, rows, slot)
            return Exchanged(mean=mean.view_as(tensor), local=local.view_as(tensor))
        bound = self.bound(flat)
        (s,) = yield Request.max(peak_magnitude(flat, bound).reshape(1))
        packed = ternary_codes(flat, bound, float(s), self.random, slot)
        gathered = yield Request.gather(packed)
        values = s * ternary_values(s.device)  # s * t for each code
        mean = self.buffers.take(slot.key, "mean", flat)
        for rank, (rank_packed,) in enumerate(gathered):
            decode(rank_packed, 2, values / slot.world_size, out=mean, add=rank > 0)
        local = decode(packed, 2, values, out=self.buffers.take(slot.key, "local", flat))
        return Exchanged(mean=mean.view_as(tensor), local=local.view_as(tensor))

    def _exchange_rows(
        self, flat: Tensor, rows: int, slot: Slot
    ) -> Generator[Request, Any, tuple[Tensor, Tensor]]:
        """The per-row exchange of ``flat`` seen as ``rows`` rows: returns (mean, local)."""
        matrix = flat.view(rows, -1)
        bounds, peaks = row_bounds_and_peaks(matrix, self.clip_sigma)
        (s,) = yield Request.max(peaks)
        packed = ternary_codes_rows(matrix, bounds, s, self.random, slot)
        gathered = yield Request.gather(packed)
        ternary = ternary_values(flat.device)
        mean = self.buffers.take(slot.key, "mean", flat)
        for rank, (rank_packed,) in enumerate(gathered):
            decode(rank_packed, 2, ternary / slot.world_size, out=mean, add=rank > 0)
        local = decode(packed, 2, ternary, out=self.buffers.take(slot.key, "local", flat))
        scalers = s.to(flat.dtype).unsqueeze(1)
        mean.view(rows, -1).mul_(scalers)
        local.view(rows, -1).mul_(scalers)
        return mean, local

    def exchange_segmented(
        self, flat: Tensor, shapes: Sequence[torch.Size], slots: Sequence[Slot]
    ) -> Exchange:
        """:meth:`exchange` for small tensors side by side in ``flat``: each tensor, or each
        of its rows where :meth:`exchange` scales per row, is a segment with its own bound
        and scaler (round 1: a max all-reduce of them all); the codes of all of them are
        rounded as :func:`ternary_codes_rows` does and packed together."""
        check_floating(flat)
        segments = self._segments.get(tuple(shapes))
        if segments is None:
            segments = self._segments.setdefault(tuple(shapes), self._row_segments(shapes))
        peaks = segments.max(flat.abs()).float()
        bound = None
        if self.clip_sigma is not None:
            lengths = segments.counts(flat.device).double()
            rms = (segments.sums(flat.double().square()) / lengths).sqrt_()
            bounds = (rms * self.clip_sigma).float()
            torch.minimum(peaks, bounds, out=peaks)
            bound = segments.expand(bounds)
        (s,) = yield Request.max(peaks)
        scaler = segments.expand(s)
        c = flat.to(torch.float32, copy=True)
        if bound is not None:
            c = torch.clamp(c, -bound, bound, out=c)
        ratio = c.div_(torch.where(scaler > 0, scaler, 1.0)).mul_(2.0**16)
        words = torch.empty(-(-flat.numel() // 4), dtype=torch.int64, device=flat.device)
        noise = self.random.words_(words, slots[0]).bitwise_or_(ODD)
        y = noise.view(torch.int16)[: flat.numel()].float().add_(ratio).add_(ROUNDER)
        codes = y.view(torch.int32).to(torch.uint8)  # the lowest byte: t + 1
        gathered = yield Request.gather(pack(codes, 2))
        scaler = scaler.to(flat.dtype)
        local = codes.to(flat.dtype).sub_(1).mul_(scaler)
        ayes = torch.zeros_like(flat)
        for (rank_packed,) in gathered:
            ayes.add_(unpack(rank_packed, 2, flat.numel()).to(flat.dtype).sub_(1))
        mean = ayes.mul_(scaler).div_(slots[0].world_size)
        return Exchanged(mean=mean, local=local)

    def _row_segments(self, shapes: Sequence[torch.Size]) -> Segments:
        """One segment per row of each tensor scaled per row, else per tensor."""
        return row_segments(shapes, scaled_rows if self.per_row else lambda shape: None)

    def bound(self, flat: Tensor) -> float | None:
        """The clip bound ``clip_sigma * sqrt(mean(flat²))`` (an fp32 value), or ``None``
        when clipping is off."""
        if self.clip_sigma is None:
            return None
        rms = l2_norm(flat) / math.sqrt(max(flat.numel(), 1))
        return float(rms * self.clip_sigma)


def peak_magnitude(flat: Tensor, bound: float | None = None) -> Tensor:
    """``max |clamp(flat, ±bound)|`` as a 0-d fp32 tensor (0 for an empty tensor), in one
    pass over ``flat``."""
    if flat.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=flat.device)
    low, high = torch.aminmax(flat)
    peak = torch.maximum(high, low.neg()).float()
    return peak if bound is None else peak.clamp_max(bound)


#: fp32 numbers from 2**39 to 2**40 are 2**16 apart, so adding ``ROUNDER`` to 2**16 * x
#: rounds x to an integer t (for |x| < 3/2) and leaves t + 1 in the lowest byte of the sum
ROUNDER = 3 * 2.0**38 + 2.0**16
#: sets the lowest bit of each 16-bit lane of a 64-bit word
ODD = 0x0001_0001_0001_0001


def ternary_codes(
    flat: Tensor, bound: float | None, s: float, random: RankStream, slot: Slot
) -> Tensor:
    """The packed codes ``t + 1`` of ``t = round(clamp(flat, ±bound) / s + v)``.

    Per chunk, in fp32: ``2**16 v`` is a random odd 16-bit integer, the sum
    ``2**16 c / s + 2**16 v + ROUNDER`` rounds to a multiple of 2**16 (ties go away from
    zero), and the lowest byte of its bits is the code. The chunk's scratch is reused.
    """
    numel = flat.numel()
    packed = torch.empty(packed_size(numel, 2), dtype=torch.uint8, device=flat.device)
    scale = 2.0**16 / s if 0 < s < math.inf else 0.0  # s = 0: every c is 0
    boost = 2.0**64 if scale > 2.0**100 else 1.0  # keeps the fp32 scale finite for tiny s
    chunk = chunk_for(flat.device)
    size = min(numel, chunk)
    clipped, rounded = (torch.empty(size, device=flat.device) for _ in range(2))
    words = torch.empty(-(-size // 4), dtype=torch.int64, device=flat.device)
    codes = torch.empty(size, dtype=torch.uint8, device=flat.device)
    for part in chunks(numel, chunk):
        count = part.stop - part.start
        if bound is not None and flat.dtype == torch.float32:
            c = torch.clamp(flat[part], -bound, bound, out=clipped[:count])
        else:
            c = clipped[:count].copy_(flat[part])  # in fp32
            if bound is not None:
                c.clamp_(-bound, bound)
        if boost != 1.0:
            c.mul_(boost)
        noise = random.words_(words[: -(-count // 4)], slot).bitwise_or_(ODD)
        y = rounded[:count].copy_(noise.view(torch.int16)[:count])  # 2**16 v
        y.add_(c, alpha=scale / boost).add_(ROUNDER)
        code = codes[:count].copy_(y.view(torch.int32))  # the lowest byte
        pack(code, 2, out=packed[part.start // 4 : packed_size(part.stop, 2)])
    return packed


def row_bounds_and_peaks(matrix: Tensor, clip_sigma: float | None) -> tuple[Tensor | None, Tensor]:
    """Per row of ``matrix``: the clip bound ``clip_sigma * sqrt(mean(row²))`` (``None``
    without clipping) and the peak ``max |clamp(row, ±bound)|``, fp32 vectors of one entry
    per row, a block of rows at a time (the squares are summed in fp64: no under- or
    overflow)."""
    rows, cols = matrix.shape
    peaks = torch.empty(rows, dtype=torch.float32, device=matrix.device)
    bounds = None if clip_sigma is None else torch.empty_like(peaks)
    step = _rows_per_block(cols, matrix.device)
    for lo in range(0, rows, step):
        hi = min(rows, lo + step)
        block = matrix[lo:hi]
        low, high = torch.aminmax(block, dim=1)
        peaks[lo:hi] = torch.maximum(high, low.neg()).float()
        if bounds is not None:
            rms = torch.linalg.vector_norm(block, dim=1, dtype=torch.float64) / math.sqrt(cols)
            bounds[lo:hi] = (rms * clip_sigma).float()
    if bounds is not None:
        torch.minimum(peaks, bounds, out=peaks)
    return bounds, peaks


def ternary_codes_rows(
    matrix: Tensor, bounds: Tensor | None, s: Tensor, random: RankStream, slot: Slot
) -> Tensor:
    """The packed codes ``t + 1`` of ``t = round(clamp(row, ±bound_j) / s_j + v)`` for every
    row ``j`` of ``matrix``, row after row; the rounding of :func:`ternary_codes`, a block
    of rows at a time (a multiple of four rows, so every block starts on a whole byte)."""
    rows, cols = matrix.shape
    packed = torch.empty(packed_size(rows * cols, 2), dtype=torch.uint8, device=matrix.device)
    divisors = torch.where(s > 0, s, torch.ones_like(s)).unsqueeze(1)  # s_j = 0: c[j] is 0
    step = _rows_per_block(cols, matrix.device)
    for lo in range(0, rows, step):
        hi = min(rows, lo + step)
        count = (hi - lo) * cols
        c = matrix[lo:hi].to(torch.float32, copy=True)
        if bounds is not None:
            bound = bounds[lo:hi].unsqueeze(1)
            c.clamp_(-bound, bound)
        ratio = c.div_(divisors[lo:hi]).mul_(2.0**16).view(-1)  # 2**16 c / s, |.| <= 2**16
        words = torch.empty(-(-count // 4), dtype=torch.int64, device=matrix.device)
        noise = random.words_(words, slot).bitwise_or_(ODD)
        y = noise.view(torch.int16)[:count].float().add_(ratio).add_(ROUNDER)
        code = y.view(torch.int32).to(torch.uint8)  # the lowest byte
        pack(code, 2, out=packed[lo * cols // 4 : packed_size(hi * cols, 2)])
    return packed


def _rows_per_block(cols: int, device: torch.device) -> int:
    """Rows per block: about :func:`~thinwire.compress.bits.chunk_for` values, a multiple
    of 4."""
    return max(4, chunk_for(device) // max(cols, 1) // 4 * 4)

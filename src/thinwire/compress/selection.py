"""Where the global top-k of values spread over ranks ends, in few rounds.

The values are float32 magnitudes as their bit patterns (non-negative int32, which order
as the magnitudes do). Every rank holds some of them; each round sums a small histogram
over the ranks, so every rank takes the same decisions and ends with the same answer.

The answer is a :class:`Cut`: the values above a bin are in, the values below it out,
and of the values in the bin itself (the candidates) the ``need`` largest are in. The
rounds stop once the bin holds few more candidates than it keeps: sending those few
along (each with its value) costs fewer bytes than another histogram, and the rank that
receives every candidate resolves the cut exactly (:meth:`Cut.threshold`). The
partitioned exchange sends the candidates in the round that returns the kept entries
anyway, so the cut costs no round of its own.

- :func:`radix_cut`: radix selection, rounds of a 64-bin histogram of the next 6 bits
  among the values that match the digits chosen so far. Needs nothing known.
- :func:`windowed_cut`: one round of a 66-bin histogram of the top 13 bits (the
  exponent and 5 bits of mantissa: 32 bins an octave) in a window of 64 bins around a
  hint (last step's threshold, which moves slowly) plus a bin below and one above it;
  where its boundary bin holds too many candidates, radix rounds over the bin's lower
  bits. One round in the common case. Where the k-th falls outside the window it says
  so and :func:`select_cut` falls back to radix selection (one round lost).
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from thinwire.compress.base import Request

#: (shift, width) of the radix rounds over the 31 bits of a non-negative float32: with
#: 6-bit digits the image model at density 0.001 sent 3.24x its k entries' bytes at 8
#: ranks, with 8-bit digits in four rounds 4.52x (bench/sparse_bytes.py, one run each)
RADIX_ROUNDS = ((25, 6), (19, 6), (13, 6), (7, 6), (1, 6), (0, 1))
#: the window's bins are the values' bits above this one (13 bits: 32 bins an octave)
WINDOW_SHIFT = 18
#: bins in the window, half above the hint's bin and half below: an octave either side
WINDOW_BINS = 64
#: radix rounds over the bits below the window's (within the k-th's bin)
LOW_ROUNDS = ((12, 6), (6, 6), (0, 6))
#: the rounds stop when the boundary bin holds at most this many candidates beyond those
#: it keeps: 64 entries of 8 bytes cost about what one more 64-bin histogram of int32
#: costs on a ring all-reduce (2 x 256 bytes)
SPARE_CANDIDATES = 64


@dataclass(frozen=True)
class Cut:
    """Where the global top-k ends, the same on every rank.

    Values whose bits above ``shift`` exceed ``prefix`` are in; values whose bits above
    ``shift`` equal ``prefix`` (the boundary bin) are candidates, of which the ``need``
    largest are in (with every value equal to the ``need``-th). ``need`` None (only in
    ``Cut(0, 0)``): every value is in (there were at most k in all).
    """

    prefix: int
    shift: int
    need: int | None = None

    def candidates_or_above(self, bits: Tensor) -> Tensor:
        """Which of ``bits`` may be in: those above the boundary bin and in it."""
        return torch.bitwise_right_shift(bits, self.shift) >= self.prefix

    def threshold(self, bits: Tensor) -> int:
        """The exact threshold (keep ``bits >=`` it) given ``bits`` holding every
        candidate of every rank (and any values above the bin, which are ignored)."""
        if self.need is None:
            return 0
        in_bin = bits[torch.bitwise_right_shift(bits, self.shift) == self.prefix]
        return int(torch.topk(in_bin, self.need).values[-1])


def select_cut(bits: Tensor, k: int, hint: int = 0) -> Generator[Request, Any, Cut]:
    """The cut of the k largest of every rank's ``bits``: through the window around
    ``hint`` where there is one and the k-th lies in it, else by radix selection.
    ``hint`` must be the same on every rank."""
    if hint > 0:
        found = yield from windowed_cut(bits, k, hint)
        if found is not None:
            return found
    return (yield from radix_cut(bits, k))


def radix_cut(
    bits: Tensor,
    k: int,
    rounds: tuple[tuple[int, int], ...] = RADIX_ROUNDS,
    matching: Tensor | None = None,
    prefix: int = 0,
) -> Generator[Request, Any, Cut]:
    """The cut of the k largest of every rank's ``bits`` by radix selection over the
    digits of ``rounds`` (most significant first), among the values ``matching`` (all by
    default) whose higher bits are ``prefix``; it stops at the first digit whose bin holds
    at most :data:`SPARE_CANDIDATES` candidates beyond those it keeps. ``Cut(0, 0)``
    where there are at most k in all (only checked when choosing among all of them)."""
    need, among_all = k, matching is None
    matching = torch.ones_like(bits, dtype=torch.bool) if matching is None else matching
    for round_index, (shift, width) in enumerate(rounds):
        digits = torch.bitwise_and(torch.bitwise_right_shift(bits, shift), (1 << width) - 1)
        local = torch.bincount(digits[matching].long(), minlength=1 << width)
        (histogram,) = yield Request.sum(local.to(torch.int32))
        from_top = histogram.flip(0).long().cumsum(0).tolist()
        if round_index == 0 and among_all and from_top[-1] <= need:
            return Cut(0, 0)
        position, need, in_bin = _bin_of_kth(from_top, need)
        prefix = (prefix << width) | ((1 << width) - 1 - position)
        if in_bin - need <= SPARE_CANDIDATES:
            return Cut(prefix, shift, need)
        matching &= digits == (prefix & ((1 << width) - 1))
    return Cut(prefix, 0, need)


def windowed_cut(bits: Tensor, k: int, hint: int) -> Generator[Request, Any, Cut | None]:
    """The cut of the k largest of every rank's ``bits`` found through the window
    around ``hint`` (see the module), or None where it lies outside the window."""
    top = (1 << (31 - WINDOW_SHIFT)) - 1  # the largest bin
    low = min(max(0, (hint >> WINDOW_SHIFT) - WINDOW_BINS // 2), top + 1 - WINDOW_BINS)
    bins = torch.bitwise_right_shift(bits, WINDOW_SHIFT)
    # 0: below the window, 1 .. WINDOW_BINS: its bins from the lowest, then above it
    slot = (bins - low).clamp(-1, WINDOW_BINS) + 1
    local = torch.bincount(slot.long(), minlength=WINDOW_BINS + 2)
    (histogram,) = yield Request.sum(local.to(torch.int32))
    from_top = histogram.flip(0).long().cumsum(0).tolist()  # above, highest bin, ..., below
    if from_top[-1] <= k:
        return Cut(0, 0)
    position, need, in_bin = _bin_of_kth(from_top, k)
    if position == 0 or position == WINDOW_BINS + 1:
        return None  # the k-th is above or below the window
    prefix = low + WINDOW_BINS - position
    if in_bin - need <= SPARE_CANDIDATES:
        return Cut(prefix, WINDOW_SHIFT, need)
    return (yield from radix_cut(bits, need, LOW_ROUNDS, bins == prefix, prefix))


def _bin_of_kth(from_top: list[int], k: int) -> tuple[int, int, int]:
    """Where the k-th largest falls, given the histogram's running counts from its top
    bin: that bin's place, how many of the bin's values are among the k, and how many
    values the bin holds."""
    position = next((p for p, count in enumerate(from_top) if count >= k), len(from_top) - 1)
    above = from_top[position - 1] if position else 0
    return position, k - above, from_top[position] - above

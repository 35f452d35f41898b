"""The global k-th largest of values spread over ranks, exactly, in few rounds.

The values are float32 magnitudes as their bit patterns (non-negative int32, which order
as the magnitudes do). Every rank holds some of them; each round sums a small histogram
over the ranks, so every rank takes the same decisions and ends with the same answer.

- :func:`radix_threshold`: radix selection, six rounds of a 64-bin histogram of the next
  6 bits among the values that match the digits chosen so far. Needs nothing known.
- :func:`windowed_threshold`: one round of a 66-bin histogram of the top 13 bits (the
  exponent and 5 bits of mantissa: 32 bins an octave) in a window of 64 bins around a
  hint (last step's threshold, which moves slowly) plus a bin below and one above it;
  then the values of the bin that holds the k-th are gathered (when few: their low 18
  bits, padded to the bin's count) and every rank picks the same one, or, when many,
  three radix rounds over those 18 bits. Two rounds in the common case instead of six.
  Where the k-th falls outside the window it says so and :func:`select_threshold` falls
  back to radix selection (one round lost).
"""

from __future__ import annotations

from collections.abc import Generator
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
#: the boundary bin's values are gathered when every rank receives at most this many
#: (4 KB); otherwise :data:`LOW_ROUNDS`
BOUNDARY_MAX_RECEIVED = 1024


def select_threshold(
    bits: Tensor, k: int, world: int, hint: int = 0
) -> Generator[Request, Any, int]:
    """The k-th largest of every rank's ``bits`` (0 where there are at most k in all) on
    ``world`` ranks: through the window around ``hint`` where there is one and the k-th
    lies in it, else by radix selection. ``hint`` must be the same on every rank."""
    if hint > 0:
        found = yield from windowed_threshold(bits, k, world, hint)
        if found is not None:
            return found
    return (yield from radix_threshold(bits, k))


def radix_threshold(
    bits: Tensor,
    k: int,
    rounds: tuple[tuple[int, int], ...] = RADIX_ROUNDS,
    matching: Tensor | None = None,
    prefix: int = 0,
) -> Generator[Request, Any, int]:
    """The k-th largest of every rank's ``bits`` by radix selection over the digits of
    ``rounds`` (most significant first), among the values ``matching`` (all by default)
    whose higher bits are ``prefix``. 0 where there are at most k in all (only checked
    when choosing among all of them)."""
    need, among_all = k, matching is None
    matching = torch.ones_like(bits, dtype=torch.bool) if matching is None else matching
    for round_index, (shift, width) in enumerate(rounds):
        digits = torch.bitwise_and(torch.bitwise_right_shift(bits, shift), (1 << width) - 1)
        local = torch.bincount(digits[matching].long(), minlength=1 << width)
        (histogram,) = yield Request.sum(local.to(torch.int32))
        from_top = histogram.flip(0).long().cumsum(0)
        if round_index == 0 and among_all and int(from_top[-1]) <= need:
            return 0
        position = int(torch.searchsorted(from_top, torch.tensor(need)))
        if position:
            need -= int(from_top[position - 1])
        digit = (1 << width) - 1 - position
        prefix = (prefix << width) | digit
        matching &= digits == digit
    return prefix


def windowed_threshold(
    bits: Tensor, k: int, world: int, hint: int
) -> Generator[Request, Any, int | None]:
    """The k-th largest of every rank's ``bits`` found through the window around
    ``hint`` (see the module), or None where it lies outside the window."""
    top = (1 << (31 - WINDOW_SHIFT)) - 1  # the largest bin
    low = min(max(0, (hint >> WINDOW_SHIFT) - WINDOW_BINS // 2), top + 1 - WINDOW_BINS)
    bins = torch.bitwise_right_shift(bits, WINDOW_SHIFT)
    # 0: below the window, 1 .. WINDOW_BINS: its bins from the lowest, then above it
    slot = (bins - low).clamp(-1, WINDOW_BINS) + 1
    local = torch.bincount(slot.long(), minlength=WINDOW_BINS + 2)
    (histogram,) = yield Request.sum(local.to(torch.int32))
    from_top = histogram.flip(0).long().cumsum(0)  # above, highest bin, ..., below
    if int(from_top[-1]) <= k:
        return 0
    position = int(torch.searchsorted(from_top, torch.tensor(k)))
    if position == 0 or position == WINDOW_BINS + 1:
        return None  # the k-th is above or below the window
    need = k - int(from_top[position - 1])
    in_bin = int(from_top[position] - from_top[position - 1])
    prefix = low + WINDOW_BINS - position
    matching = bins == prefix
    if in_bin * (world - 1) > BOUNDARY_MAX_RECEIVED:
        return (yield from radix_threshold(bits, need, LOW_ROUNDS, matching, prefix))
    # no rank holds more than the bin's count: each sends that many, padded with -1
    low_bits = torch.bitwise_and(bits[matching], (1 << WINDOW_SHIFT) - 1)
    padded = torch.full((in_bin,), -1, dtype=torch.int32, device=bits.device)
    padded[: low_bits.numel()] = low_bits
    gathered = yield Request.gather(padded)
    every = torch.cat([values for (values,) in gathered])
    every = every[every >= 0]
    kth = torch.topk(every, need).values[-1]
    return (prefix << WINDOW_SHIFT) | int(kth)

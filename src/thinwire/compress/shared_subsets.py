"""Uniform random k-subsets of many small tensors at once, the same on every rank.

Random-k keeps, of a tensor of ``n`` values, ``k`` entries drawn uniformly without
replacement, from a seed every rank derives from the shared seed, the tensor's key and
the step. A bucket's small tensors are drawn together, with a fixed number of
operations whatever their count: tensor ``i``'s draws are the positions

    pos_ij = mix(seed_i + (j + 1) * GAMMA) mod n_i        j = 0, 1, 2, ...

(``mix``: SplitMix64's output function, a counter-based generator, so every tensor's
draws of a whole bucket come from one vectorised expression), and the tensor keeps its
first ``k_i`` distinct positions in draw order, which is a uniform k-subset (sampling
without replacement by rejection). A tensor's subset depends on its seed, ``n_i`` and
``k_i`` only: not on its neighbours, nor on how many draws were made (more draws only
lengthen the sequence), so it is the same alone or side by side in any layout. Drawn on
the CPU (the entries do not depend on the data); a caller moves them to its device.
Cost: about ``n ln(n / (n - k))`` draws per tensor (``k (1 + k / 2n)`` for small
densities), against sorting or scoring all ``n`` values.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor


def _signed(value: int) -> int:
    """A 64-bit pattern as the int64 that holds it."""
    return value - (1 << 64) if value >= 1 << 63 else value


GAMMA = _signed(0x9E3779B97F4A7C15)
_MUL1 = _signed(0xBF58476D1CE4E5B9)
_MUL2 = _signed(0x94D049BB133111EB)
#: positions are below 2**32: a draw's (tensor, position) key fits one int64
_SHIFT = 32


def mix(x: Tensor) -> Tensor:
    """SplitMix64's output function of the int64 ``x`` (wrapping arithmetic, logical
    shifts), in place."""
    x.bitwise_xor_((x >> 30) & ((1 << 34) - 1)).mul_(_MUL1)
    x.bitwise_xor_((x >> 27) & ((1 << 37) - 1)).mul_(_MUL2)
    return x.bitwise_xor_((x >> 31) & ((1 << 33) - 1))


def draws_needed(n: int, k: int) -> int:
    """Draws that give ``k`` distinct positions of ``n`` with a margin: the expected
    count ``n (H(n) - H(n - k))`` plus four of its standard deviations and 8."""
    if k >= n:
        return 0
    expected = n * (math.log(n + 0.5) - math.log(n - k + 0.5))
    return math.ceil(expected + 4 * math.sqrt(expected) + 8)


class SharedSubsets:
    """The draws for tensors of ``sizes`` keeping ``ks`` entries each (each ``n`` below
    2**32); made once per layout."""

    def __init__(self, sizes: Sequence[int], ks: Sequence[int]) -> None:
        pairs = list(zip(sizes, ks, strict=True))
        if any(not 0 < k <= n < 1 << _SHIFT for n, k in pairs):
            raise ValueError(f"need 0 < k <= n < 2**32 for each tensor, got (n, k) = {pairs}")
        self.sizes, self.ks = list(sizes), list(ks)
        starts = [0]
        for n in self.sizes[:-1]:
            starts.append(starts[-1] + n)
        self._starts = torch.tensor(starts)
        self._draws = [draws_needed(n, k) for n, k in zip(self.sizes, self.ks, strict=True)]
        self._sizes_at, self._ks_at = torch.tensor(self.sizes), torch.tensor(self.ks)
        #: per kept entry (in :meth:`pick`'s order), the fraction k / n of its tensor
        self.kept_fraction = torch.cat(
            [torch.full((k,), k / n) for n, k in zip(self.sizes, self.ks, strict=True)]
        )

    def pick(self, seeds: Sequence[int]) -> Tensor:
        """Flat indices (int64, on the CPU) of each tensor's subset for its 64-bit seed,
        grouped by tensor in order, each tensor's sorted."""
        draws = list(self._draws)
        while True:
            chosen, short = self._try(seeds, draws)
            if not short:
                return chosen
            for i in short:  # rare: draw more for these; the first draws stay the same
                draws[i] *= 2

    def _try(self, seeds: Sequence[int], draws: list[int]) -> tuple[Tensor, list[int]]:
        counts = torch.tensor(draws)
        owner = torch.repeat_interleave(torch.arange(len(draws)), counts)
        # each draw's number within its tensor: 1, 2, ... (j + 1 above)
        ends = counts.cumsum(0)
        number = torch.arange(1, int(ends[-1]) + 1 if draws else 1) - (ends - counts)[owner]
        state = torch.tensor([_signed(s) for s in seeds])[owner].add_(number.mul_(GAMMA))
        position = (mix(state) & ((1 << 63) - 1)).remainder_(self._sizes_at[owner])
        keys = (owner << _SHIFT) | position
        unique, inverse = torch.unique(keys, return_inverse=True)
        order = torch.arange(keys.numel())
        first = torch.full((unique.numel(),), keys.numel()).scatter_reduce_(
            0, inverse, order, "amin"
        )
        fresh = first[inverse] == order  # a position's first draw
        seen = fresh.cumsum(0)
        before = torch.cat([seen.new_zeros(1), seen])[ends - counts]  # fresh before a tensor
        rank = seen - before[owner]  # 1 for a tensor's first fresh draw, 2 for its next, ...
        taken = fresh & (rank <= self._ks_at[owner])
        got = torch.zeros(len(draws), dtype=torch.int64).index_add_(0, owner, taken.long())
        # a tensor keeping all its entries draws nothing: every position
        whole = [i for i, d in enumerate(draws) if d == 0]
        short = [i for i, d in enumerate(draws) if d and int(got[i]) < self.ks[i]]
        if short:
            return keys, short
        kept = keys[taken]
        if whole:
            every = [(i << _SHIFT) + torch.arange(self.sizes[i]) for i in whole]
            kept = torch.cat([kept, *every])
        kept = kept.sort().values
        return (kept & ((1 << _SHIFT) - 1)) + self._starts[kept >> _SHIFT], []

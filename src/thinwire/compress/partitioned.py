"""The partitioned sparse all-reduce: a global top-k whose bytes per rank do not grow with N.

Gathering every rank's top-k (what :func:`~thinwire.compress.topk.gather_sparse` does)
makes each rank receive ``(N - 1) k`` entries. Here each rank owns a contiguous range of
the tensor's flat index space instead (a partition), and a step takes three stages:

1. **to the owners**: each rank sends every one of its k entries to the rank that owns
   its index (an uneven all-to-all, ``Request.scatter``); each owner sums what arrived;
2. **prune in the middle**: where the global k-th largest magnitude of those sums lies
   is found on their float32 bit patterns (:mod:`thinwire.compress.selection`): on a
   tensor's first step by radix selection, 64-bin histograms summed over every rank
   (usually two or three rounds), after that in one round, a 66-bin histogram of a
   window around last step's threshold; either stops at a bin (the boundary bin) that
   holds few candidates beyond those it keeps. Each owner keeps its sums above that bin
   and in it;
3. **back to every rank**: each owner sends what it kept to every rank, and every rank,
   holding all the candidates, resolves the boundary bin exactly (the same on every
   rank) and drops the candidates that did not make it.

What every rank then holds is the global top-k of the summed sparse gradients (ties at
the threshold all kept), divided by N, bit for bit what gathering would give at those
places. An entry a rank sent that was pruned was not applied: it stays in the rank's
error-feedback memory (only the surviving indices are reported as sent), so nothing is
lost. Each rank sends about 2k entries and receives about 2k (if the partitions are
balanced), plus the histograms (264 bytes through the window, twice that on the ring)
and at most :data:`~thinwire.compress.selection.SPARE_CANDIDATES` spare candidates in
all (more only where values tie), whatever N. The small rounds are the price: three
after a tensor's first step (the all-to-alls and the histogram); on a ring all-reduce
the histogram waits ``2 (N - 1)`` network delays, on the ``direct`` communicator one
(for ``N - 1`` copies of its bytes).

With ``keep`` > 1 the prune keeps the global top ``keep * k`` of the sum while each
rank still sends its k: at many ranks the ranks' picks barely overlap, so a global top-k
applies only a small share of what they picked (8.5 % at 16 ranks in
``bench/partitioned_drift.py``) and the rest waits in their memories; keeping 4 k of the
sum applies more of it for ``keep * k`` entries back instead of k (docs/sparse.md,
"keep=K"). Where the ranks' picks cover at most ``keep * k`` places,
all of them are kept.

The protocol is :func:`~thinwire.compress.partitioned_runs.partitioned_run`, for one
tensor or a bucket's tensors at once; this module holds what it keeps between steps
(:class:`Partitions`) and when it pays (:func:`partition_pays`).

The partitions start as equal ranges and are re-balanced every ``rebalance_every`` steps
so that each holds as many of the last selection's entries (which every rank received
alike, so all compute the same boundaries). Where the large entries fall changes only
the bytes, never the result, so the boundaries are not checkpointed; nor are the last
thresholds (they change the rounds, never the result).
"""

from __future__ import annotations

import torch
from torch import Tensor

from thinwire.compress.selection import WINDOW_BINS

#: the bytes of one rank's histogram per tensor in a step after its first (the window's
#: int32 bins; a first step takes two or three radix rounds of 256 bytes)
HISTOGRAM_BYTES = 4 * (WINDOW_BINS + 2)
#: bytes of one sparse entry on the wire: an fp32 value and an int32 index
ENTRY_BYTES = 8


def partition_pays(k: int, world: int, keep: int = 1) -> bool:
    """Whether the partitioned exchange sends fewer bytes than gathering for ``k`` entries
    on ``world`` ranks, by estimate: gathering sends ``(N - 1) k`` entries; the
    partitioned exchange about ``k`` to the owners and ``keep * k`` back (the global top
    ``keep * k``), plus a histogram, ring all-reduced (its steady state: the window)."""
    gathered = ENTRY_BYTES * k * (world - 1)
    partitioned = (1 + keep) * ENTRY_BYTES * k + 2 * HISTOGRAM_BYTES
    return world > 1 and gathered > partitioned


class Partitions:
    """Each rank's range of every tensor's flat index space, by tensor key.

    Args:
        rebalance_every: steps between re-balancings (0: keep equal ranges).
    """

    def __init__(self, rebalance_every: int) -> None:
        self.rebalance_every = rebalance_every
        self._bounds: dict[str, Tensor] = {}
        self._thresholds: dict[str, int] = {}

    def threshold_hint(self, key: str) -> int:
        """Last step's threshold of ``key`` (float32 bits; 0: none yet), the centre of
        this step's window (:mod:`thinwire.compress.selection`)."""
        return self._thresholds.get(key, 0)

    def remember_threshold(self, key: str, bits: int) -> None:
        """``key``'s threshold this step, every rank's the same."""
        self._thresholds[key] = bits

    def bounds(self, key: str, numel: int, world: int) -> Tensor:
        """The ``world + 1`` boundaries of ``key``'s partitions (rank r owns
        ``[bounds[r], bounds[r + 1])``)."""
        found = self._bounds.get(key)
        if found is None or found.numel() != world + 1 or int(found[-1]) != numel:
            found = torch.div(torch.arange(world + 1) * numel, world, rounding_mode="floor")
            self._bounds[key] = found
        return found

    def due(self, step: int) -> bool:
        """Whether the partitions are re-balanced after ``step``."""
        every = self.rebalance_every
        return bool(every) and (step + 1) % every == 0

    def rebalance(self, key: str, numel: int, world: int, selected: Tensor, step: int) -> None:
        """After ``step``, move the boundaries so that each rank owns an equal share of
        ``selected`` (the sorted flat indices every rank received), every
        ``rebalance_every`` steps."""
        if not self.due(step) or selected.numel() < world:
            return
        share = torch.div(torch.arange(1, world) * selected.numel(), world, rounding_mode="floor")
        inner = selected.cpu().index_select(0, share)
        self._bounds[key] = torch.cat(
            [torch.zeros(1, dtype=torch.int64), inner, torch.tensor([numel])]
        )

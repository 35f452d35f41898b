"""The partitioned sparse all-reduce (:mod:`thinwire.compress.partitioned`) of one tensor
or of a bucket's tensors at once: one protocol, not one per tensor.

Run one tensor at a time, each round costs some forty small operations per tensor: at
16 ranks on the image model's 20 partitioned tensors that work, between dependent
collectives, decided the step (docs/sparse.md, "On sixteen cores"). Here a run of
tensors side by side takes the same rounds with each round's work done for all of them
together:

1. **to the owners**: every entry's owner found by one search over all the tensors'
   partition boundaries laid end to end, one sort by (owner, index), one scatter;
   each owner sums what arrived with one ``unique`` and one ``index_add_``;
2. **the cuts**: each tensor's :func:`~thinwire.compress.selection.select_cut` as
   before, their histograms summed in one request a round (tensors whose cut is found
   drop out; every rank drops the same ones);
3. **back to every rank**: one scatter carrying every owner's kept candidates and,
   for the tensors where partitioning does not pay (``partition_pays``), this rank's own
   entries, which every rank adds source by source, as gathering does.

The result, the applied indices and the rounds are those of each tensor exchanged alone
(and of :func:`~thinwire.compress.topk.gather_sparse` for the gathered tensors), bit for
bit on the CPU (tests/test_partitioned_runs.py).
"""

from __future__ import annotations

import itertools
from collections.abc import Generator, Sequence
from typing import Any

import torch
from torch import Tensor

from thinwire.compress.base import Op, Request, Slot
from thinwire.compress.partitioned import Partitions, partition_pays
from thinwire.compress.selection import Cut, select_cut


def partitioned_run(
    picks: Sequence[tuple[Tensor, Tensor]],
    ks: Sequence[int],
    flat: Tensor,
    sizes: Sequence[int],
    slots: Sequence[Slot],
    partitions: Partitions,
    keep: int = 1,
) -> Generator[Request, Any, tuple[Tensor, Tensor, list[int]]]:
    """Exchange each tensor's ``picks`` (its ``(indices, values)`` of its ``ks`` entries,
    indices its own) of the tensors of ``sizes`` side by side in ``flat``; a partitioned
    tensor applies the global top ``keep * k`` of the sum (all of it where the ranks'
    picks cover fewer places). Returns the mean (shaped as ``flat``), the indices of
    ``flat`` at which this rank's entries were applied, grouped by tensor in order, and
    how many of them each tensor has."""
    world = slots[0].world_size
    starts = [0]
    for size in sizes[:-1]:
        starts.append(starts[-1] + size)
    pays = [partition_pays(k, world, keep) for k in ks]
    paying = [j for j, pay in enumerate(pays) if pay]
    gathered = [j for j, pay in enumerate(pays) if not pay]
    own_at = [picks[j][0] + starts[j] for j in gathered]
    own = [picks[j][1] for j in gathered]
    if not paying:
        from thinwire.compress.topk import gather_sparse  # (topk imports this module)

        mean = yield from gather_sparse(torch.cat(own), torch.cat(own_at), flat, world)
        return mean, *_grouped(torch.cat(own_at), starts, sizes)
    run = _Paying(paying, starts, sizes, [keep * k for k in ks], slots, partitions)
    at = torch.cat([picks[j][0] + starts[j] for j in paying])
    values = torch.cat([picks[j][1] for j in paying])
    owner = run.owners(at)
    order = torch.argsort(owner * flat.numel() + at)
    at, values = at.index_select(0, order), values.index_select(0, order)
    counts = torch.bincount(owner, minlength=world).tolist()
    arrived = yield Request.scatter(counts, values, at.to(torch.int32))
    sums_at, sums = _sum_arrivals(arrived, flat)
    bits = sums.abs().view(torch.int32)
    cuts = yield from run.cut(sums_at, bits)
    kept = [cut.candidates_or_above(piece) for cut, piece in zip(cuts, run.pieces, strict=True)]
    keep = torch.cat(kept)
    own_count = sum(int(t.numel()) for t in own_at)
    echo_values = torch.cat([*own, sums[run.span][keep]])
    echo_at = torch.cat([*own_at, sums_at[run.span][keep]]).to(torch.int32)
    echoed = yield Request.scatter(
        [echo_values.numel()] * world, echo_values.repeat(world), echo_at.repeat(world)
    )
    echoed_values, echoed_at = echoed[0], echoed[1].long()
    mine = run.inside(echoed_at)  # the partitioned tensors' candidates; else gathered
    mean = torch.zeros_like(flat)
    if own_count:  # source by source, in rank order, as gathering adds them
        gathered_at = echoed_at[~mine].view(world, own_count)
        gathered_values = echoed_values[~mine].view(world, own_count)
        for source in range(world):
            mean.index_add_(0, gathered_at[source], gathered_values[source])
        for j in gathered:  # the sums divided where they lie (0 / N is 0 elsewhere)
            mean[starts[j] : starts[j] + sizes[j]].div_(world)
    selected_at, selected = echoed_at[mine], echoed_values[mine]
    final = run.settle(cuts, selected_at, selected.abs().view(torch.int32))
    selected_at, selected = selected_at[final], selected[final]
    mean.index_copy_(0, selected_at, selected.div(world))
    hit = torch.zeros(flat.numel(), dtype=torch.bool, device=flat.device)
    hit[selected_at] = True  # (a mask: torch.isin costs several times more here)
    applied = at[hit[at]]  # (a padded pick repeats an index)
    run.rebalance(selected_at)
    return mean, *_grouped(torch.cat([applied, *own_at]), starts, sizes)


class _Paying:
    """The tensors of a run that take the partitioned exchange: their places in the run,
    their partitions, and each step's per-tensor pieces of the owners' sums."""

    def __init__(
        self,
        members: list[int],
        starts: list[int],
        sizes: Sequence[int],
        ks: Sequence[int],
        slots: Sequence[Slot],
        partitions: Partitions,
    ) -> None:
        self.partitions = partitions
        self.world = slots[0].world_size
        self.slots = [slots[j] for j in members]
        self.starts = [starts[j] for j in members]
        self.sizes = [sizes[j] for j in members]
        self.ks = [ks[j] for j in members]
        bounds = [
            partitions.bounds(slot.key, size, self.world)[:-1] + start
            for slot, size, start in zip(self.slots, self.sizes, self.starts, strict=True)
        ]
        #: every tensor's partition starts, end to end (non-decreasing)
        self.table = torch.cat(bounds)
        #: where each partitioned tensor starts, and where the last one ends
        self.edges = torch.tensor([*self.starts, self.starts[-1] + self.sizes[-1]])
        #: each partitioned tensor's start and end, in turn
        ends = [start + size for start, size in zip(self.starts, self.sizes, strict=True)]
        pairs = zip(self.starts, ends, strict=True)
        self.ranges = torch.tensor([edge for pair in pairs for edge in pair])
        self.pieces: list[Tensor] = []
        self.span = slice(0, 0)

    def owners(self, at: Tensor) -> Tensor:
        """The rank owning each run index ``at`` (all in partitioned tensors)."""
        table = self.table.to(at.device)
        return (torch.searchsorted(table, at, right=True) - 1) % self.world

    def cut(self, sums_at: Tensor, bits: Tensor) -> Generator[Request, Any, list[Cut]]:
        """Each tensor's cut of its owners' sums (``bits``, at the sorted run indices
        ``sums_at``), their histograms summed together, one request a round."""
        places = torch.searchsorted(sums_at, self.edges.to(sums_at.device)).tolist()
        spans = [slice(a, b) for a, b in itertools.pairwise(places)]
        self.span = slice(places[0], places[-1])
        self.pieces = [bits[span] for span in spans]
        searches = [
            select_cut(piece, k, self.partitions.threshold_hint(slot.key))
            for piece, slot, k in zip(self.pieces, self.slots, self.ks, strict=True)
        ]
        cuts: list[Cut | None] = [None] * len(searches)
        answers: list[Any] = [None] * len(searches)
        while True:
            asking, requests = [], []
            for i, search in enumerate(searches):
                if cuts[i] is not None:
                    continue
                try:
                    request = search.send(answers[i])
                except StopIteration as stop:
                    cuts[i] = stop.value
                    continue
                if request.op is not Op.SUM or len(request.tensors) != 1:
                    raise AssertionError("a cut asked for something other than one sum")
                asking.append(i)
                requests.append(request.tensors[0])
            if not asking:
                break
            (summed,) = yield Request.sum(torch.cat(requests))
            for i, part in zip(asking, summed.split([r.numel() for r in requests]), strict=True):
                answers[i] = (part,)
        return [cut for cut in cuts if cut is not None]

    def inside(self, at: Tensor) -> Tensor:
        """Which run indices ``at`` belong to a partitioned tensor."""
        places = torch.searchsorted(self.ranges.to(at.device), at, right=True)
        return places % 2 == 1

    def settle(self, cuts: list[Cut], at: Tensor, bits: Tensor) -> Tensor:
        """Which of every rank's candidates (run indices ``at``, magnitudes ``bits``)
        make their tensor's global top-k; each tensor's threshold remembered. Every
        tensor's boundary bin is resolved at once: its candidates sorted by tensor, then
        by magnitude from the top, and the ``need``-th of each tensor's taken (what
        :meth:`Cut.threshold` takes one tensor at a time)."""
        device = at.device
        tensor = torch.searchsorted(self.edges.to(device), at, right=True) - 1
        shifts = torch.tensor([cut.shift for cut in cuts], dtype=torch.int32, device=device)
        prefixes = torch.tensor([cut.prefix for cut in cuts], dtype=torch.int32, device=device)
        in_bin = torch.bitwise_right_shift(bits, shifts[tensor]) == prefixes[tensor]
        owners, found = tensor[in_bin], bits[in_bin].long()
        # by tensor, then largest first (bits are magnitudes: 0 <= bits < 2**31)
        ordered = torch.sort(owners * (1 << 31) + ((1 << 31) - 1 - found)).values
        firsts = torch.bincount(owners, minlength=len(cuts)).cumsum(0).tolist()
        thresholds = []
        for i, cut in enumerate(cuts):
            threshold = 0
            if cut.need is not None:
                place = (firsts[i - 1] if i else 0) + cut.need - 1
                threshold = (1 << 31) - 1 - int(ordered[place]) % (1 << 31)
            self.partitions.remember_threshold(self.slots[i].key, threshold)
            thresholds.append(threshold)
        limits = torch.tensor(thresholds, dtype=torch.int32, device=device)
        return bits >= limits[tensor]

    def rebalance(self, selected_at: Tensor) -> None:
        """Move the partitions where the step's selection fell, when they are due."""
        step = self.slots[0].step
        if not self.partitions.due(step):
            return
        tensor = torch.searchsorted(self.edges.to(selected_at.device), selected_at, right=True)
        for i, (slot, size, start) in enumerate(
            zip(self.slots, self.sizes, self.starts, strict=True)
        ):
            mine = selected_at[tensor - 1 == i] - start
            self.partitions.rebalance(slot.key, size, self.world, mine, step)


def _sum_arrivals(arrived: list[Tensor], flat: Tensor) -> tuple[Tensor, Tensor]:
    """The distinct run indices that arrived (sorted) and their sums, added in source
    rank order (the order gathering adds them in, so the bits match)."""
    values, at = arrived[0], arrived[1].long()
    distinct, where = torch.unique(at, return_inverse=True)
    sums = torch.zeros(distinct.numel(), dtype=flat.dtype, device=flat.device)
    return distinct, sums.index_add_(0, where, values)


def _grouped(sent: Tensor, starts: list[int], sizes: Sequence[int]) -> tuple[Tensor, list[int]]:
    """``sent`` (run indices) sorted, so grouped by tensor, and how many each tensor has."""
    ordered = torch.sort(sent).values
    edges = torch.tensor([*starts[1:], starts[-1] + sizes[-1]], dtype=torch.int64)
    ends = torch.searchsorted(ordered, edges.to(ordered.device)).tolist()
    return ordered, [b - a for a, b in zip([0, *ends[:-1]], ends, strict=True)]

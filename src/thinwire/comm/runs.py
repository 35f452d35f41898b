"""How the engine groups a bucket's tensors into exchange *runs*, each one protocol.

A protocol per tensor costs a few kernels and some Python per tensor, which on a GPU or
with little compute per step costs more than the step itself (62 tensors: twice DDP's
step for no compression). So the engine hands a compressor as much of a bucket at once
as its math allows:

- **side by side**: an element-wise compressor (each value's payload depends on that
  value alone: ``none``, ``fp16``, ``bf16``), and every tensor a compressor declines (sent
  dense), exchange all such tensors of the bucket as one flat tensor: no copy where they
  already lie side by side in memory (a DDP bucket), one protocol, one finiteness check;
- **stacked**: a compressor that batches same-shaped tensors (``Compressor.batches``,
  PowerSGD) gets each shape's tensors stacked into one ``(count, *shape)`` tensor;
- **segments**: a compressor that scales per tensor or per row (``Compressor.segmented``:
  1-bit SGD, signSGD) gets its small tensors (up to
  :data:`~thinwire.compress.segments.SMALL` values) side by side, and works on them as
  segments of one flat tensor;
- **the whole bucket**: a compressor that takes all its tensors of a bucket at once
  (``Compressor.bucket_as_segments``: PowerSGD on a GPU) gets them side by side as one
  run of segments, whatever their shapes (a batching one, with same shapes together);
- **alone**: every other tensor, one protocol each, as before.

The values each tensor's exchange computes are the same whichever way it runs; a run's
outcome is split back into one :class:`~thinwire.compress.base.Exchanged` per tensor.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from thinwire.comm.survey import Survey
from thinwire.compress.base import Compressor, Exchange, Exchanged, Memory, RunUpdate, Slot
from thinwire.compress.segments import SMALL, side_by_side


@dataclass
class Run:
    """One protocol in progress for the bucket's tensors ``members`` (their indices):
    their slots, whether the compressor (not the dense fallback) handles them, what
    each one compensated to (the memory's own tensors, which it updates), the request
    it waits on, and per member its outcome."""

    members: list[int]
    slots: Sequence[Slot]
    compressed: bool
    correcteds: Sequence[Tensor]
    protocol: Exchange
    #: the outcome split per member (``False``: without each one's sent indices)
    split: Callable[[Exchanged, bool], list[Exchanged]]
    request: Any = None
    #: whether ``members`` are all the bucket's tensors in its order (:func:`in_bucket_order`)
    in_order: bool = False
    #: the protocol's outcome once it returned, before it is split per member
    outcome: Exchanged | None = None
    _results: list[Exchanged] | None = None

    def advance(self, answer: Any) -> None:
        """Hand the protocol ``answer`` (``None`` to start it); keep its next request, or
        its outcome once it returns."""
        try:
            self.request = self.protocol.send(answer)
        except StopIteration as stop:
            self.request, self.outcome = None, stop.value

    @property
    def done(self) -> bool:
        """Whether the protocol has returned."""
        return self.outcome is not None

    @property
    def results(self) -> list[Exchanged]:
        """Each member's outcome (split from the run's on first use)."""
        if self._results is None:
            if self.outcome is None:
                raise RuntimeError("this run's protocol has not returned yet")
            self._results = self.split(self.outcome, True)
        return self._results

    def means(self) -> list[Tensor]:
        """Each member's mean (what a gradient needs: its sent indices are not split)."""
        if self._results is not None:
            return [result.mean for result in self._results]
        if self.outcome is None:
            raise RuntimeError("this run's protocol has not returned yet")
        return [result.mean for result in self.split(self.outcome, False)]


def flatten(tensors: Sequence[Tensor]) -> Tensor:
    """The tensors' values side by side in one flat tensor (a view where they already
    are, else one copy)."""
    flat = side_by_side(tensors) if tensors else None
    if flat is not None:
        return flat
    return torch.cat([t.reshape(-1) for t in tensors])


def split_flat(like: Sequence[Tensor]) -> Callable[[Exchanged, bool], list[Exchanged]]:
    """How to split the outcome of a run of tensors shaped as ``like``, side by side, into
    one outcome per tensor (sent indices back in each tensor's own numbering)."""
    known: list[list[int]] = []  # the sizes, found at the first split (often none is)

    def sizes_of() -> list[int]:
        if not known:
            known.append([t.numel() for t in like])
        return known[0]

    def pieces(flat: Tensor | None) -> list[Tensor | None]:
        if flat is None:
            return [None] * len(like)
        parts = flat.split_with_sizes(sizes_of())
        return [
            p if p.shape == t.shape else p.view(t.shape) for p, t in zip(parts, like, strict=True)
        ]

    def split(outcome: Exchanged, with_indices: bool = True) -> list[Exchanged]:
        means, locals_ = pieces(outcome.mean), pieces(outcome.local)
        indices: list[Tensor | None] = [None] * len(like)
        if outcome.sent_indices is not None and with_indices:
            if outcome.sent_counts is None or len(outcome.sent_counts) != len(like):
                raise ValueError("a run side by side reported sent indices without their counts")
            sent = outcome.sent_indices
            # each index less its tensor's start, in one subtraction
            shifts = _index_shifts(tuple(sizes_of()), tuple(outcome.sent_counts), sent.device)
            indices = list((sent - shifts).split_with_sizes(list(outcome.sent_counts)))
        return [
            Exchanged(mean=m, local=lo, sent_indices=i)
            for m, lo, i in zip(means, locals_, indices, strict=True)
        ]

    return split


_SHIFTS: dict[tuple[tuple[int, ...], tuple[int, ...], torch.device], Tensor] = {}


def _index_shifts(sizes: tuple[int, ...], counts: tuple[int, ...], device: torch.device) -> Tensor:
    """Per sent index of a side-by-side run (``counts[i]`` of tensor ``i``), the start of
    its tensor in the run; made once per layout and device (a copy from the host per step
    would make a GPU's host wait)."""
    key = (sizes, counts, device)
    shifts = _SHIFTS.get(key)
    if shifts is None:
        starts = torch.tensor([0, *sizes[:-1]], dtype=torch.int64).cumsum(0)
        shifts = torch.repeat_interleave(starts, torch.tensor(counts, dtype=torch.int64))
        if len(_SHIFTS) > 256:  # layouts change rarely (counts do, partitioned); bounded
            _SHIFTS.clear()
        shifts = _SHIFTS[key] = shifts.to(device)
    return shifts


def _split_stacked(count: int) -> Callable[[Exchanged, bool], list[Exchanged]]:
    def split(outcome: Exchanged, with_indices: bool = True) -> list[Exchanged]:
        if outcome.sent_indices is not None:
            raise ValueError("a batching compressor reported sent indices")
        local = outcome.local
        return [
            Exchanged(mean=outcome.mean[i], local=None if local is None else local[i])
            for i in range(count)
        ]

    return split


def _alone(outcome: Exchanged, with_indices: bool = True) -> list[Exchanged]:
    return [outcome]


@dataclass
class Planned:
    """A run about to start: its members, the tensor its protocol exchanges, whether the
    compressor handles it, and whether it lies over its members without a copy."""

    members: list[int]
    tensor: Tensor
    compressed: bool
    stacked: bool = False
    #: the members' shapes, for a run of segments
    shapes: list[torch.Size] | None = None

    def pieces(self) -> list[Tensor]:
        """The parts of :attr:`tensor` that are each member's (to name a non-finite one)."""
        if len(self.members) == 1 and not self.stacked:
            return [self.tensor]
        if self.stacked:
            return list(self.tensor.unbind(0))
        return list(self.tensor.split_with_sizes(self.sizes))

    sizes: list[int] | None = None


@dataclass(frozen=True)
class Group:
    """The members of a run to be, and how they go: ``"flat"`` (side by side),
    ``"segments"`` (side by side, as segments), ``"stacked"`` (by shape) or ``"alone"``."""

    members: list[int]
    how: str
    compressed: bool


def group_runs(
    kinds: Sequence[tuple[torch.Size, Any]], compressed: Sequence[bool], compressor: Compressor
) -> list[Group]:
    """How a bucket's tensors, of ``kinds`` (shape and dtype-and-device, by index), group
    into runs (see the module docstring): the dense ones side by side, then the compressed
    ones side by side, stacked by shape, or alone, in the bucket's order within each kind.
    The same for the gradients and for what a memory compensates them to, given the
    memory's dtype (a memory lays its buffers out by it: :meth:`Memory.arrange`)."""
    dense = [i for i, c in enumerate(compressed) if not c]
    chosen = [i for i, c in enumerate(compressed) if c]
    groups = [Group(g, "flat", False) for g in _by_kind(dense, kinds, lambda k: k[1])]
    if compressor.elementwise:
        return groups + [Group(g, "flat", True) for g in _by_kind(chosen, kinds, lambda k: k[1])]
    if chosen and compressor.bucket_as_segments(kinds[chosen[0]][1][1]):
        by_kind = _by_kind(chosen, kinds, lambda k: k[1])
        if compressor.batches:  # one batched product per shape: same shapes side by side
            by_kind = [_shapes_together(g, kinds) for g in by_kind]
        return groups + [Group(g, "segments", True) for g in by_kind]
    if compressor.batches:
        for g in _by_kind(chosen, kinds, lambda k: k):
            groups.append(Group(g, "stacked" if len(g) > 1 else "alone", True))
        return groups
    if not compressor.segmented:
        return groups + [Group([i], "alone", True) for i in chosen]
    small = [i for i in chosen if math.prod(kinds[i][0]) <= SMALL]
    groups += [Group(g, "segments", True) for g in _by_kind(small, kinds, lambda k: k[1])]
    large = [i for i in chosen if math.prod(kinds[i][0]) > SMALL]
    if large and compressor.segments_large(kinds[large[0]][1][1]):
        return groups + [Group(g, "segments", True) for g in _by_kind(large, kinds, lambda k: k[1])]
    return groups + [Group([i], "alone", True) for i in large]


def plan_runs(
    correcteds: Sequence[Tensor],
    compressed: Sequence[bool],
    compressor: Compressor,
    whole: Tensor | None = None,
    sizes: Sequence[int] | None = None,
) -> list[Planned]:
    """Group a bucket's compensated tensors into runs (:func:`group_runs`) and lay each
    one's tensor out: a view where its members lie side by side, else a copy.
    ``whole``: every tensor of the bucket side by side, known to the caller (a DDP
    bucket's buffer), for a run of them all; ``sizes``: the tensors' sizes, if known."""
    chosen = any(compressed)
    if whole is not None and (not chosen or (all(compressed) and compressor.elementwise)):
        sizes = list(sizes) if sizes is not None else [t.numel() for t in correcteds]
        return [Planned(list(range(len(correcteds))), whole, chosen, sizes=sizes)]
    kinds = [(t.shape, (t.dtype, t.device)) for t in correcteds]
    planned = []
    for group in group_runs(kinds, compressed, compressor):
        tensors = [correcteds[i] for i in group.members]
        if group.how == "alone":
            planned.append(Planned(group.members, tensors[0], group.compressed))
        elif group.how == "stacked":
            flat = side_by_side(tensors)
            stacked = (
                torch.stack(tensors)
                if flat is None
                else flat.view(len(tensors), *kinds[group.members[0]][0])
            )
            planned.append(Planned(group.members, stacked, True, stacked=True))
        else:
            sizes = [t.numel() for t in tensors]
            run = Planned(group.members, flatten(tensors), group.compressed, sizes=sizes)
            if group.how == "segments":
                run.shapes = [t.shape for t in tensors]
            planned.append(run)
    return planned


def arrange_memory(
    memory: Memory,
    grads: Sequence[Tensor],
    slots: Sequence[Slot],
    compressed: Sequence[bool],
    compressor: Compressor,
) -> list[list[int]]:
    """Have ``memory`` hold the state of each run to be side by side
    (:meth:`~thinwire.compress.base.Memory.arrange`): a run of what it compensates to is
    then one flat tensor without a copy, and its sent entries are zeroed at once. The
    runs are grouped as :func:`plan_runs` will group the memory's fp32 buffers. Returns
    the positions of each group so arranged."""
    kinds = [(g.shape, (torch.float32, g.device)) for g in grads]
    arranged = []
    for group in group_runs(kinds, compressed, compressor):
        if len(group.members) > 1:
            keys = [slots[i].key for i in group.members]
            memory.arrange(keys, [grads[i] for i in group.members])
            arranged.append(group.members)
    return arranged


def sums_show(planned: Sequence[Planned], compressor: Compressor, dense: Compressor) -> bool:
    """Whether a NaN or an infinity in any of the ``planned`` runs reaches the sums
    their exchanges ask for (every run's compressor is
    :attr:`~thinwire.compress.base.Compressor.transparent`)."""
    return all((compressor if run.compressed else dense).transparent for run in planned)


def _shapes_together(members: list[int], kinds: Sequence[Any]) -> list[int]:
    """``members`` with tensors of one matrix shape (rows, the rest) side by side, each
    shape where its first tensor was, the bucket's order kept within a shape."""
    first: dict[tuple[int, ...], int] = {}

    def matrix(i: int) -> tuple[int, ...]:
        shape = kinds[i][0]
        return (shape[0], math.prod(shape) // shape[0]) if shape and shape[0] else tuple(shape)

    for i in members:
        first.setdefault(matrix(i), len(first))
    return sorted(members, key=lambda i: first[matrix(i)])


def in_bucket_order(members: Sequence[int], count: int) -> bool:
    """Whether a run's ``members`` are all ``count`` tensors of its bucket, in the bucket's
    order (a run may hold them in another: PowerSGD's groups its shapes)."""
    return len(members) == count and all(i == m for i, m in enumerate(members))


def _by_kind(members: list[int], kinds: Sequence[Any], key: Callable) -> list[list[int]]:
    groups: dict[Any, list[int]] = {}
    for i in members:
        groups.setdefault(key(kinds[i]), []).append(i)
    return list(groups.values())


def start_run(
    planned: Planned,
    correcteds: Sequence[Tensor],
    slots: Sequence[Slot],
    compressor: Compressor,
    dense: Compressor,
) -> Run:
    """Start ``planned``'s protocol up to its first request (``correcteds`` and ``slots``:
    the whole bucket's, by index)."""
    members = planned.members
    everyone = in_bucket_order(members, len(correcteds))
    member_slots = slots if everyone else [slots[i] for i in members]  # (not copied: read only)
    member_correcteds = correcteds if everyone else [correcteds[i] for i in members]
    chosen = compressor if planned.compressed else dense
    if planned.shapes is not None:
        protocol = chosen.exchange_segmented(planned.tensor, planned.shapes, member_slots)
        split = split_flat(member_correcteds)
    elif len(members) == 1 and not planned.stacked and planned.sizes is None:
        protocol = chosen.exchange(planned.tensor, member_slots[0])
        split = _alone
    elif chosen.elementwise:
        protocol = chosen.exchange(planned.tensor, _run_slot(member_slots))
        split = split_flat(member_correcteds)
    else:
        protocol = chosen.exchange_stacked(planned.tensor, member_slots)
        split = _split_stacked(len(members))
    run = Run(members, member_slots, planned.compressed, member_correcteds, protocol, split)
    run.in_order = everyone
    run.advance(None)
    return run


def _run_slot(slots: Sequence[Slot]) -> Slot:
    """The slot of a side-by-side run: its first tensor's (element-wise compressors keep
    no state by key)."""
    return slots[0]


class Means(Sequence[Tensor]):
    """The averaged gradients of a bucket, in its order, made on first use by ``build``;
    ``flat``: all of them side by side in one tensor when one flat run carried the whole
    bucket in its dtype (a DDP hook hands DDP that tensor itself), else ``None``."""

    def __init__(
        self,
        build: Callable[[], list[Tensor]],
        count: int,
        flat: Tensor | None,
        pieces: Callable[[], list[tuple[Tensor, Tensor]] | None] = lambda: None,
    ):
        self._build: Callable[[], list[Tensor]] | None = build
        self._means: list[Tensor] = []
        self._count = count
        self.flat = flat
        self._pieces = pieces

    def pieces(self) -> list[tuple[Tensor, Tensor]] | None:
        """``(positions, flat mean)`` of each run, where several side-by-side runs carried
        the whole bucket in its dtype: the positions of a run's values among the bucket's
        values side by side (a DDP hook puts each run's mean into the bucket's buffer in
        one operation); else ``None``."""
        return self._pieces()

    def _all(self) -> list[Tensor]:
        if self._build is not None:
            self._means, self._build = self._build(), None
        return self._means

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, index: Any) -> Any:
        return self._all()[index]

    def __iter__(self) -> Iterator[Tensor]:
        return iter(self._all())


def whole_bucket(runs: Sequence[Run], known: Survey) -> Tensor | None:
    """The flat mean of a bucket (``known``: its survey, with the gradients' ``sizes``,
    ``total`` and common ``dtype``) if one side-by-side run carried all of it, in order
    and in the gradients' dtype; else ``None``."""
    if len(runs) != 1:
        return None
    run = runs[0]
    outcome = run.outcome
    if outcome is None or outcome.mean.dim() != 1 or not run.in_order:
        return None
    if known.dtype != outcome.mean.dtype or outcome.mean.numel() != known.total:
        return None
    return outcome.mean


def bucket_means(runs: Sequence[Run], grads: Sequence[Tensor], known: Survey) -> Means:
    """The means of a bucket of ``grads`` (``known``: its survey) that ``runs``
    exchanged, made on first use."""
    whole = whole_bucket(runs, known)
    return Means(lambda: run_means(runs, grads), len(grads), whole, lambda: run_pieces(runs, known))


def run_pieces(runs: Sequence[Run], known: Survey) -> list[tuple[Tensor, Tensor]] | None:
    """:meth:`Means.pieces` of ``runs``: where each run's mean is one flat tensor in the
    gradients' dtype and the runs carry every gradient of the bucket once, each mean
    with the positions of its values in the bucket; else ``None``."""
    if len(runs) < 2 or known.dtype is None:
        return None
    means = [run.outcome.mean if run.outcome is not None else None for run in runs]
    if any(m is None or m.dim() != 1 or m.dtype != known.dtype for m in means):
        return None
    positions = known.positions(tuple(tuple(run.members) for run in runs), means[0].device)
    if positions is None:
        return None
    return list(zip(positions, means, strict=True))


def run_means(runs: Sequence[Run], grads: Sequence[Tensor]) -> list[Tensor]:
    """Each gradient's mean, shaped and typed as the gradient."""
    means: list[Tensor] = [grads[0]] * len(grads)
    for run in runs:
        for i, mean in zip(run.members, run.means(), strict=True):
            grad = grads[i]
            if mean.shape != grad.shape:
                mean = mean.reshape(grad.shape)
            means[i] = mean if mean.dtype == grad.dtype else mean.to(grad.dtype)
    return means


def update_memory(memory: Memory, runs: Sequence[Run]) -> None:
    """Let ``memory`` keep what ``runs`` did not send (splitting a run's outcome per
    tensor only if the memory needs it)."""
    updates = []
    for run in runs:
        if run.outcome is None:
            raise RuntimeError("this run's protocol has not returned yet")
        results = lambda run=run: run.results  # noqa: E731
        updates.append(RunUpdate(run.correcteds, run.outcome, results, run.slots, run.compressed))
    memory.update_runs(updates)

"""Per-key state kept twice, so that a step can be undone: the memories' buffers.

A refused step (a NaN on some rank, a failed collective) must leave no trace, so the state
a step writes goes into a second set of buffers until the step is committed. A group of
keys that always begins and commits together (a bucket's run) can have its buffers laid
out side by side, so that its state is also one flat tensor per set: a memory then
compensates the whole group in a few operations instead of a few per tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from thinwire.compress.device_undo import where_many
from thinwire.compress.segments import side_by_side


class StepBuffers:
    """Per-key fp32 state (``count`` tensors per key), kept twice so a step can be undone.

    :meth:`begin` hands out the state the last committed step left (zeros for a new key or
    shape) and buffers for the state this step writes; the step's state is *pending* until
    :meth:`commit` keeps it or :meth:`rollback` drops it. A key's pending state is also
    kept when the key begins again, so a caller that never commits still carries its
    state from one exchange to the next. The buffers a commit retires hold the next
    step's state.
    """

    def __init__(self, count: int) -> None:
        self.count = count
        self.kept: dict[str, tuple[Tensor, ...]] = {}
        self._pending: dict[str, tuple[Tensor, ...]] = {}
        self._spare: dict[str, tuple[Tensor, ...]] = {}
        #: bumped whenever a buffer is made or replaced other than by a step's swap
        self._version = 0
        #: groups of keys laid out side by side, and the version they were checked at
        self._arranged: dict[tuple[str, ...], int] = {}
        #: the two sets of flat blocks (``count`` tensors each) a group was laid out in
        self._blocks: dict[tuple[str, ...], list[list[Tensor]]] = {}

    def arrange(self, keys: Sequence[str], likes: Sequence[Tensor]) -> None:
        """Lay the state of ``keys`` (shaped as ``likes``) out side by side, in this
        order, in one block per state tensor and per set (kept and spare), keeping its
        values. Since every key of a group begins, commits and rolls back together, a
        step's swap keeps the blocks whole: this copies once, then checks nothing until
        some buffer is made or replaced."""
        group = tuple(keys)
        if len(group) < 2 or self._arranged.get(group) == self._version:
            return
        for key in group:
            self._keep(key)
        if not self._side_by_side(group, likes):
            self._lay_out(group, likes)
        self._arranged[group] = self._version

    def _side_by_side(self, keys: tuple[str, ...], likes: Sequence[Tensor]) -> bool:
        for states in (self.kept, self._spare):
            held = [states.get(key) for key in keys]
            shapes = zip(held, likes, strict=True)
            if any(h is None or h[0].shape != like.shape for h, like in shapes):
                return False
            for c in range(self.count):
                if side_by_side([h[c] for h in held if h is not None]) is None:
                    return False
        return True

    def _lay_out(self, keys: tuple[str, ...], likes: Sequence[Tensor]) -> None:
        total = sum(like.numel() for like in likes)
        device = likes[0].device
        blocks = [
            [torch.zeros(total, dtype=torch.float32, device=device) for _ in range(self.count)]
            for _ in range(2)
        ]
        offset = 0
        for key, like in zip(keys, likes, strict=True):
            end = offset + like.numel()
            kept, spare = (tuple(b[offset:end].view(like.shape) for b in set_) for set_ in blocks)
            old = self.kept.get(key)
            if old is not None and old[0].shape == like.shape:
                torch._foreach_copy_(list(kept), list(old))
            self.kept[key], self._spare[key] = kept, spare
            offset = end
        taken = set(keys)  # a key's older blocks are no longer its own: let them go
        self._blocks = {g: b for g, b in self._blocks.items() if taken.isdisjoint(g)}
        self._blocks[keys] = blocks
        self._version += 1

    def begin(self, key: str, like: Tensor) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
        """``(kept, fresh)`` for ``key``: its committed state, and the buffers (contents
        undefined) that this step writes its new state into."""
        self._keep(key)
        kept = self.kept.get(key)
        if kept is None or kept[0].shape != like.shape:
            kept = self._new(like, torch.zeros)
            self.kept[key] = kept
        fresh = self._spare.pop(key, None)
        if fresh is None or fresh[0].shape != like.shape:
            fresh = self._new(like, torch.empty)
        self._pending[key] = fresh
        return kept, fresh

    def begin_flat(
        self, keys: Sequence[str], likes: Sequence[Tensor]
    ) -> tuple[list[tuple[Tensor, ...]], tuple[Tensor, ...], tuple[Tensor, ...]] | None:
        """:meth:`begin` for every key of a group :meth:`arrange` laid out side by side
        (in this order), with the group's state as flat tensors: ``(fresh per key, kept
        flats, fresh flats)``, one flat tensor per state tensor; ``None`` (nothing begun)
        where the keys are not such a group, or its layout changed since."""
        group = tuple(keys)
        blocks = self._blocks.get(group)
        if blocks is None or self._arranged.get(group) != self._version:
            return None
        for key in group:  # as begin() does first: a step never committed is kept
            self._keep(key)
        pairs = [(self.kept.get(key), self._spare.get(key)) for key in group]
        for (kept, spare), like in zip(pairs, likes, strict=True):
            if kept is None or spare is None or not kept[0].shape == spare[0].shape == like.shape:
                return None  # begin() would make a buffer: not the blocks any more
        found = _new_and_old(blocks, pairs[0][1], pairs[0][0])
        if found is None:
            return None
        fresh = [self.begin(key, like)[1] for key, like in zip(group, likes, strict=True)]
        return fresh, tuple(found[1]), tuple(found[0])

    def current(self, key: str) -> tuple[Tensor, ...]:
        """``key``'s newest state: this step's if it began, else the committed one."""
        return self._pending.get(key) or self.kept[key]

    def latest(self) -> dict[str, tuple[Tensor, ...]]:
        """Every key's newest state (:meth:`current`)."""
        return {**self.kept, **self._pending}

    def commit(self) -> None:
        """Keep every pending state."""
        for key in list(self._pending):
            self._keep(key)

    def commit_unless(self, refused: Tensor) -> None:
        """:meth:`commit`, with every pending state first put back to the committed one
        wherever the bool device flag ``refused`` is true (a step refused on the device:
        nothing is read back). A group laid out side by side takes one ``where`` per state
        tensor over its block; other keys go together through :func:`where_many`."""
        done: set[str] = set()
        for group, blocks in self._blocks.items():
            if self._arranged.get(group) != self._version or any(
                key not in self._pending for key in group
            ):
                continue
            found = _new_and_old(blocks, self._pending[group[0]], self.kept[group[0]])
            if found is not None:
                for after, before in zip(*found, strict=True):
                    torch.where(refused, before, after, out=after)
                done.update(group)
        rest = [key for key in self._pending if key not in done]
        where_many(
            refused,
            [kept for key in rest for kept in self.kept[key]],
            [fresh for key in rest for fresh in self._pending[key]],
        )
        self.commit()

    def rollback(self) -> None:
        """Drop every pending state; its buffers serve the next step."""
        self._spare.update(self._pending)
        self._pending.clear()

    def load(self, kept: dict[str, tuple[Tensor, ...]]) -> None:
        """Replace the committed state; nothing is pending afterwards."""
        self.kept = dict(kept)
        self._pending.clear()
        self._spare.clear()
        self._blocks.clear()
        self._version += 1

    def _keep(self, key: str) -> None:
        fresh = self._pending.pop(key, None)
        if fresh is None:
            return
        retired = self.kept.get(key)
        self.kept[key] = fresh
        if retired is not None and retired[0].shape == fresh[0].shape:
            self._spare[key] = retired

    def _new(self, like: Tensor, make: Any) -> tuple[Tensor, ...]:
        self._version += 1
        return tuple(
            make(like.shape, dtype=torch.float32, device=like.device) for _ in range(self.count)
        )


def _new_and_old(
    blocks: list[list[Tensor]], fresh: tuple[Tensor, ...], kept: tuple[Tensor, ...]
) -> tuple[list[Tensor], list[Tensor]] | None:
    """Which of a group's two sets of blocks holds the step's state (``fresh``, its first
    key's buffers) and which the committed one (``kept``): ``(new, old)``, or ``None``
    where the buffers are not the blocks' starts."""
    starts = (fresh[0].data_ptr(), kept[0].data_ptr())
    for new, old in ((blocks[1], blocks[0]), (blocks[0], blocks[1])):
        if starts == (new[0].data_ptr(), old[0].data_ptr()):
            return new, old
    return None

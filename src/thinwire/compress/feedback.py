"""Error-feedback memories: none, the plain residual, and DGC's momentum-corrected memory.

Residual (error feedback, Seide et al. 2014; Karimireddy et al. 2019)::

    corrected = g + e          # compensate
    e = corrected - sent       # update: what the compressor dropped waits for next step

DGC (Lin et al. 2018), per tensor, with momentum ``m`` moved out of the optimizer::

    g = clip(g + wd * w, max_norm / sqrt(N))   # local gradient clipping
    u = m * u + g                              # momentum correction: accumulate velocity
    v = v + u                                  # accumulate (this is what is compressed)
    v[sent] = 0                                # residual update
    u[sent] = 0                                # momentum factor masking (if masking)

The optimizer must then apply the averaged ``v`` with plain SGD (no second momentum).
Tensors the compressor declines (1-D biases and norms) still get ``u`` and ``v`` but are
sent whole, so they see ordinary momentum SGD and no masking. All buffers are fp32.

A refused step (a NaN on some rank, a failed collective) must leave no trace: the state a
step writes goes into a second set of buffers (:class:`StepBuffers`) until the step is
committed, so a rollback only has to drop it. The memories hold their state twice for
that, and allocate nothing after the first two steps.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from thinwire.compress.base import Compressor, Exchanged, Memory, RunUpdate, Slot, is_real
from thinwire.compress.segments import side_by_side
from thinwire.compress.step_buffers import StepBuffers


class NoMemory(Memory):
    """No error feedback: compress the gradient as it is (unbiased compressors, fp16)."""

    def compensate(self, grad: Tensor, slot: Slot, param: Tensor | None = None) -> Tensor:
        """Return the gradient in fp32, unchanged."""
        return grad if grad.dtype == torch.float32 else grad.float()

    def compensate_many(
        self,
        grads: Sequence[Tensor],
        slots: Sequence[Slot],
        params: Sequence[Tensor | None],
        groups: Sequence[Sequence[int]] = (),
    ) -> list[Tensor]:
        """Every gradient in fp32 (the same tensors where they are)."""
        return [g if g.dtype == torch.float32 else g.float() for g in grads]

    def update(self, corrected: Tensor, sent: Exchanged, slot: Slot, compressed: bool) -> None:
        """Nothing to remember."""


class ResidualMemory(Memory):
    """Classic error feedback: add last step's residual, keep what was not sent."""

    def __init__(self) -> None:
        self._buffers = StepBuffers(1)

    @property
    def residuals(self) -> dict[str, Tensor]:
        """Every tensor key's newest residual (this step's once it was compensated)."""
        return {key: state[0] for key, state in self._buffers.latest().items()}

    def compensate(self, grad: Tensor, slot: Slot, param: Tensor | None = None) -> Tensor:
        """``corrected = residual + grad``, in a buffer of the memory's that
        :meth:`update` then turns into the next residual."""
        (residual,), (corrected,) = self._buffers.begin(slot.key, grad)
        return torch.add(residual, grad, out=corrected)

    def update(self, corrected: Tensor, sent: Exchanged, slot: Slot, compressed: bool) -> None:
        """``residual = corrected - sent``; exact zeroing for sparsifiers."""
        _subtract_sent(corrected, sent)

    def compensate_many(
        self,
        grads: Sequence[Tensor],
        slots: Sequence[Slot],
        params: Sequence[Tensor | None],
        groups: Sequence[Sequence[int]] = (),
    ) -> list[Tensor]:
        """:meth:`compensate` for a bucket: two operations for each group of ``groups``
        (its gradients copied side by side into its buffers, its residuals added), two
        multi-tensor operations for the rest; the same arithmetic as one by one."""
        if not _uniform(grads):
            return super().compensate_many(grads, slots, params)

        def together(kept: tuple[Tensor, ...], fresh: tuple[Tensor, ...], gs: list) -> None:
            torch.cat([g.reshape(-1) for g in gs], out=fresh[0]).add_(kept[0])

        done = _compensate_groups(self._buffers, grads, slots, groups, together)
        rest = [i for i, state in enumerate(done) if state is None]
        begun = [self._buffers.begin(slots[i].key, grads[i]) for i in rest]
        residuals = [kept[0] for kept, _ in begun]
        for i, (_, fresh) in zip(rest, begun, strict=True):
            done[i] = fresh
        correcteds = [fresh[0] for _, fresh in begun]
        if begun:
            torch._foreach_copy_(correcteds, residuals)
            torch._foreach_add_(correcteds, [grads[i] for i in rest])
        return _column(done, 0)

    def update_many(
        self,
        correcteds: Sequence[Tensor],
        sents: Sequence[Exchanged],
        slots: Sequence[Slot],
        compressed: bool,
    ) -> None:
        """:meth:`update` for a run: what was sent dense subtracted in one multi-tensor
        operation, sparse sends zeroed one by one."""
        _subtract_all_sent(correcteds, sents)

    def update_runs(self, runs: Sequence[RunUpdate]) -> None:
        """A bucket's runs: each run's sent entries zeroed in one operation where its
        buffers lie side by side (:meth:`arrange`), what went dense subtracted in one
        multi-tensor operation for all runs; the same arithmetic as :meth:`update`."""
        _update_runs(runs, None)

    def arrange(self, keys: Sequence[str], likes: Sequence[Tensor]) -> None:
        """Residuals of one run side by side (:meth:`StepBuffers.arrange`)."""
        self._buffers.arrange(keys, likes)

    def commit(self) -> None:
        """This step's residuals are the ones the next step adds."""
        self._buffers.commit()

    undoes_on_device = True

    def commit_unless(self, refused: Tensor) -> None:
        """:meth:`commit`, the residuals put back where the device flag ``refused`` is set."""
        self._buffers.commit_unless(refused)

    def rollback(self) -> None:
        """Back to the residuals the last committed step left."""
        self._buffers.rollback()

    def state_dict(self) -> dict[str, Any]:
        """The residual of every tensor key."""
        return {"residuals": {k: v.clone() for k, v in self.residuals.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore residuals."""
        self._buffers.load({k: (v.clone(),) for k, v in state.get("residuals", {}).items()})


@dataclass
class DGCMemory(Memory):
    """DGC's memory: momentum correction, local clipping, momentum factor masking.

    Options:
        momentum: the momentum ``m`` DGC applies (the optimizer must not add its own).
        max_norm: clip each worker's gradient to norm ``max_norm / sqrt(N)`` per tensor
            before accumulation; ``None`` disables clipping.
        masking: zero the momentum of every sent entry (momentum factor masking, as
            published; off by default, see :class:`~thinwire.compress.dgc.DGC`).
        weight_decay: added to the gradient before momentum (``g + wd * w``).
    """

    momentum: float = 0.9
    max_norm: float | None = None
    masking: bool = False
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        if not is_real(self.momentum) or not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"momentum must be a number in [0, 1), got {self.momentum!r}")
        if self.max_norm is not None and not (is_real(self.max_norm) and self.max_norm > 0):
            raise ValueError(f"max_norm must be a number > 0 or None, got {self.max_norm!r}")
        if not is_real(self.weight_decay) or self.weight_decay < 0:
            raise ValueError(
                f"weight_decay must be a finite number >= 0, got {self.weight_decay!r}"
            )
        if not isinstance(self.masking, bool):
            raise ValueError(f"masking must be true or false, got {self.masking!r}")
        self._buffers = StepBuffers(2)  # (u, v) of every tensor key

    @property
    def velocities(self) -> dict[str, Tensor]:
        """Every tensor key's newest velocity ``u``."""
        return {key: state[0] for key, state in self._buffers.latest().items()}

    @property
    def accumulators(self) -> dict[str, Tensor]:
        """Every tensor key's newest accumulator ``v``."""
        return {key: state[1] for key, state in self._buffers.latest().items()}

    def compensate(self, grad: Tensor, slot: Slot, param: Tensor | None = None) -> Tensor:
        """``u = m*u + clip(g + wd*w)``; ``v += u``; return ``v`` (this step's ``u`` and
        ``v`` are new buffers; the last step's stay as they were until :meth:`commit`)."""
        (u_kept, v_kept), (u, v) = self._buffers.begin(slot.key, grad)
        scale = 1.0
        if self.max_norm is not None:
            limit = self.max_norm / math.sqrt(slot.world_size)
            norm = float(torch.linalg.vector_norm(grad, dtype=torch.float32))
            if norm > limit:
                scale = limit / (norm + 1e-12)
        torch.mul(u_kept, self.momentum, out=u).add_(grad, alpha=scale)
        if self.weight_decay and param is not None:
            u.add_(param.detach(), alpha=self.weight_decay * scale)
        return torch.add(v_kept, u, out=v)

    def compensate_many(
        self,
        grads: Sequence[Tensor],
        slots: Sequence[Slot],
        params: Sequence[Tensor | None],
        groups: Sequence[Sequence[int]] = (),
    ) -> list[Tensor]:
        """:meth:`compensate` for a bucket: for each group of ``groups`` four operations
        over its side-by-side state (without weight decay), for the rest a few
        multi-tensor operations; the same arithmetic, in the same order, as one by one.
        With clipping, one tensor at a time."""
        if self.max_norm is not None or not _uniform(grads):
            return super().compensate_many(grads, slots, params)

        def together(kept: tuple[Tensor, ...], fresh: tuple[Tensor, ...], gs: list) -> None:
            (u_kept, v_kept), (u, v) = kept, fresh
            torch.mul(u_kept, self.momentum, out=v)  # v holds m * u until it is written
            torch.cat([g.reshape(-1) for g in gs], out=u).add_(v)
            torch.add(v_kept, u, out=v)

        done = _compensate_groups(
            self._buffers, grads, slots, () if self.weight_decay else groups, together
        )
        rest = [i for i, state in enumerate(done) if state is None]
        begun = [self._buffers.begin(slots[i].key, grads[i]) for i in rest]
        for i, (_, fresh) in zip(rest, begun, strict=True):
            done[i] = fresh
        if begun:
            us = [fresh[0] for _, fresh in begun]
            vs = [fresh[1] for _, fresh in begun]
            torch._foreach_copy_(us, [kept[0] for kept, _ in begun])
            torch._foreach_mul_(us, self.momentum)
            torch._foreach_add_(us, [grads[i] for i in rest])
            decayed = [(u, params[i]) for u, i in zip(us, rest, strict=True)]
            decayed = [(u, p.detach()) for u, p in decayed if p is not None]
            if self.weight_decay and decayed:
                torch._foreach_add_(
                    [u for u, _ in decayed], [p for _, p in decayed], alpha=self.weight_decay
                )
            torch._foreach_copy_(vs, [kept[1] for kept, _ in begun])
            torch._foreach_add_(vs, us)
        return _column(done, 1)

    def update_many(
        self,
        correcteds: Sequence[Tensor],
        sents: Sequence[Exchanged],
        slots: Sequence[Slot],
        compressed: bool,
    ) -> None:
        """:meth:`update` for a run: what was sent dense (a run of norms and biases)
        subtracted in one multi-tensor operation, sparse sends zeroed one by one; the same
        arithmetic."""
        _subtract_all_sent(correcteds, sents)
        if self.masking and compressed:
            for sent, slot in zip(sents, slots, strict=True):
                self._mask(sent, slot)

    def update_runs(self, runs: Sequence[RunUpdate]) -> None:
        """As :class:`ResidualMemory`'s; with masking, a compressed run's velocities
        zeroed where it sent, in one more operation where they lie side by side."""
        _update_runs(runs, self._mask_run if self.masking else None)

    def _mask_run(self, run: RunUpdate, whole: bool) -> None:
        """Momentum factor masking for a compressed run (``whole``: its outcome's sent
        indices cover all its tensors, laid out side by side)."""
        if not run.compressed:
            return
        velocities = [self._buffers.current(slot.key)[0] for slot in run.slots]
        if whole and _zero_run(velocities, run.outcome):
            return
        for sent, slot in zip(run.results(), run.slots, strict=True):
            self._mask(sent, slot)

    def arrange(self, keys: Sequence[str], likes: Sequence[Tensor]) -> None:
        """Velocities and accumulators of one run side by side (:meth:`StepBuffers.arrange`)."""
        self._buffers.arrange(keys, likes)

    def update(self, corrected: Tensor, sent: Exchanged, slot: Slot, compressed: bool) -> None:
        """Zero what was sent in ``v``; with masking, also in ``u`` (compressed tensors)."""
        _subtract_sent(corrected, sent)
        if self.masking and compressed:
            self._mask(sent, slot)

    def _mask(self, sent: Exchanged, slot: Slot) -> None:
        """Momentum factor masking: zero the velocity ``u`` where ``v`` was sent."""
        u = self._buffers.current(slot.key)[0]
        if sent.sent_indices is not None:
            u.view(-1).index_fill_(0, sent.sent_indices, 0.0)
        elif sent.local is not None:
            u.masked_fill_(sent.local != 0, 0.0)

    def commit(self) -> None:
        """This step's velocities and accumulators are the ones the next step builds on."""
        self._buffers.commit()

    undoes_on_device = True

    def commit_unless(self, refused: Tensor) -> None:
        """:meth:`commit`, both put back where the device flag ``refused`` is set."""
        self._buffers.commit_unless(refused)

    def rollback(self) -> None:
        """Back to the velocities and accumulators the last committed step left."""
        self._buffers.rollback()

    def state_dict(self) -> dict[str, Any]:
        """Velocities ``u`` and accumulators ``v`` of every tensor key."""
        return {
            "velocities": {k: t.clone() for k, t in self.velocities.items()},
            "accumulators": {k: t.clone() for k, t in self.accumulators.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore velocities and accumulators."""
        velocities = state.get("velocities", {})
        accumulators = state.get("accumulators", {})
        if set(velocities) != set(accumulators):
            raise ValueError(
                "DGC memory state: the velocities and accumulators name different tensors "
                f"({sorted(set(velocities) ^ set(accumulators))}); save it with state_dict()"
            )
        self._buffers.load(
            {k: (velocities[k].clone(), accumulators[k].clone()) for k in velocities}
        )


def memory_for(compressor: Compressor, memory: Memory | None) -> Memory:
    """``memory`` checked, or ``compressor``'s own default memory when it is ``None``."""
    if memory is None:
        return compressor.make_memory()
    if not isinstance(memory, Memory):
        raise TypeError(
            "memory must be a thinwire Memory (NoMemory(), ResidualMemory() or "
            "DGCMemory(...) from thinwire.compress.feedback), or None for the "
            f"compressor's own; got {memory!r}"
        )
    return memory


def _uniform(grads: Sequence[Tensor]) -> bool:
    """Whether multi-tensor operations can take ``grads``: some, all fp32 on one device."""
    if not grads:
        return False
    device = grads[0].device
    return all(g.dtype == torch.float32 and g.device == device for g in grads)


def _compensate_groups(
    buffers: StepBuffers,
    grads: Sequence[Tensor],
    slots: Sequence[Slot],
    groups: Sequence[Sequence[int]],
    together: Callable[[tuple[Tensor, ...], tuple[Tensor, ...], list[Tensor]], None],
) -> list[tuple[Tensor, ...] | None]:
    """Begin each of ``groups`` whose state lies side by side (:meth:`StepBuffers.begin_flat`)
    and compensate it at once, ``together(kept flats, fresh flats, its gradients)``; per
    gradient its fresh state where its group was done so, else ``None``."""
    done: list[tuple[Tensor, ...] | None] = [None] * len(grads)
    for members in groups:
        if len(members) < 2:
            continue
        group_grads = [grads[i] for i in members]
        begun = buffers.begin_flat([slots[i].key for i in members], group_grads)
        if begun is None:
            continue
        fresh, kept_flats, fresh_flats = begun
        together(kept_flats, fresh_flats, group_grads)
        for i, state in zip(members, fresh, strict=True):
            done[i] = state
    return done


def _column(states: list[tuple[Tensor, ...] | None], c: int) -> list[Tensor]:
    """Each gradient's state tensor ``c`` (every gradient has begun by now)."""
    if any(state is None for state in states):
        raise RuntimeError("a gradient of the bucket was not compensated")
    return [state[c] for state in states if state is not None]


def _update_runs(runs: Sequence[RunUpdate], mask: Callable[[RunUpdate, bool], None] | None) -> None:
    """Zero each run's sent entries (a run's at once where its buffers lie side by side,
    else each tensor's), subtract every dense send of every run in one multi-tensor
    operation, and ``mask`` each run (told whether it was zeroed whole)."""
    dense: list[tuple[Tensor, Tensor]] = []
    for run in runs:
        whole = _zero_run(run.correcteds, run.outcome)
        if not whole and not _subtract_run(run.correcteds, run.outcome, dense):
            _zero_sparse(run.correcteds, run.results(), dense)
        if mask is not None:
            mask(run, whole)
    if dense:
        torch._foreach_sub_([c for c, _ in dense], [local for _, local in dense])


def _zero_sparse(
    correcteds: Sequence[Tensor], sents: Sequence[Exchanged], dense: list[tuple[Tensor, Tensor]]
) -> None:
    """Zero what the sparse sends among ``sents`` sent; add the dense ones' pairs of
    (buffer, what was sent) to ``dense``, to subtract in one multi-tensor operation."""
    for corrected, sent in zip(correcteds, sents, strict=True):
        if sent.sent_indices is not None:
            _subtract_sent(corrected, sent)
        elif sent.local is None:
            raise ValueError("an exchange reported neither what it sent nor its indices")
        else:
            dense.append((corrected, sent.local))


def _subtract_run(
    buffers: Sequence[Tensor], outcome: Exchanged, dense: list[tuple[Tensor, Tensor]]
) -> bool:
    """Add a dense run's (buffers, what it sent) to ``dense`` as one flat pair, if its
    buffers lie side by side and its outcome is one flat tensor for them all (the same
    arithmetic as a pair per tensor, without splitting the outcome); whether it did."""
    local = outcome.local
    if len(buffers) < 2 or outcome.sent_indices is not None or local is None:
        return False
    flat = side_by_side(buffers)
    if flat is None or local.dim() != 1 or local.numel() != flat.numel():
        return False
    dense.append((flat, local))
    return True


def _zero_run(buffers: Sequence[Tensor], outcome: Exchanged) -> bool:
    """Zero the entries a run of several tensors sent (``outcome.sent_indices``, in the
    run's numbering) in ``buffers`` at once, if they lie side by side; whether it did."""
    if len(buffers) < 2 or outcome.sent_indices is None:
        return False
    flat = side_by_side(buffers)
    if flat is None:
        return False
    flat.index_fill_(0, outcome.sent_indices, 0.0)
    return True


def _subtract_all_sent(correcteds: Sequence[Tensor], sents: Sequence[Exchanged]) -> None:
    """:func:`_subtract_sent` for several tensors: dense sends in one multi-tensor
    subtraction."""
    dense: list[tuple[Tensor, Tensor]] = []
    _zero_sparse(correcteds, sents, dense)
    if dense:
        torch._foreach_sub_([c for c, _ in dense], [local for _, local in dense])


def _subtract_sent(corrected: Tensor, sent: Exchanged) -> None:
    """Turn ``corrected`` (a memory's own buffer) into the residual, in place."""
    if sent.sent_indices is not None:
        corrected.view(-1).index_fill_(0, sent.sent_indices, 0.0)
    elif sent.local is not None:
        corrected.sub_(sent.local)
    else:
        raise ValueError("an exchange reported neither what it sent nor its indices")

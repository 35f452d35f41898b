"""PowerSGD (Vogels et al., NeurIPS 2019): one step of power iteration per training step.

With M the tensor as a matrix (``shape[0]`` rows; error feedback already added)::

    P      = M Q                     Q: rank columns, warm-started from the last step
    P      = orthogonalize(sum over ranks of P)
    Q      = M^T P                   this rank's Q, the error feedback's reference
    mean   = P (sum over ranks of Q)^T / N
    local  = P Q^T                   residual = M - local
    next Q = (sum over ranks of Q) / N

Only the factors travel, (n + m) * rank numbers instead of n * m, and both are summed.
The first Q comes from a generator seeded by (seed, key), identical on every rank.

Layout: the factors are kept transposed (rank x n and rank x m, row-major) and computed as
``P^T = Q^T M^T`` and ``Q^T = P^T M``. At one thread, for a 5000 x 5000 matrix and rank >= 2,
that is 3x faster for ``M Q`` and 12x faster for ``M^T P`` than the column layout (which
MKL runs as a slow thin GEMM).

Buffers: ``mean`` and ``local`` are written into two buffers per tensor key that the next
exchange of the same key overwrites. A fresh full-size tensor costs more in page faults
(about 55 ms for 100 MB) than the whole rank-1 round; callers copy the mean into the
gradient at once (the engine does), and the memory consumes ``local`` in the same step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from thinwire.compress.base import (
    Aggregation,
    Compressor,
    Exchange,
    Exchanged,
    Request,
    Slot,
    check_positive_int,
)
from thinwire.compress.device_undo import where_many
from thinwire.compress.powersgd_bucket import BucketLayout, BucketState, exchange_bucket
from thinwire.compress.randomk import stable_seed
from thinwire.compress.registry import register_compressor


@register_compressor
@dataclass
class PowerSGD(Compressor):
    """Rank-r PowerSGD with warm start; use with error feedback (the default).

    Options:
        rank: columns of the factors P and Q, an integer >= 1.
        min_compression: send a tensor dense unless ``n*m >= (n + m) * rank *
            min_compression``; 0 compresses every matrix.
        seed: seeds the first Q of every tensor (the same on every rank).
        layout: ``"stacks"``, ``"bucket"`` or ``"auto"`` (see the field below).
    """

    rank: int = 1
    min_compression: float = 2.0
    seed: int = 0
    #: how a bucket's matrices go: ``"stacks"``, each shape's stacked with a QR per
    #: stack; ``"bucket"``, all of them as one run with one Householder
    #: orthonormalisation (:mod:`thinwire.compress.powersgd_bucket`: far fewer kernels);
    #: ``"auto"``, stacks on the CPU and the bucket elsewhere. Left out of the repr (a
    #: checkpoint's owner): the warm starts are kept per tensor either way.
    layout: str = field(default="auto", repr=False)

    name = "powersgd"
    summary = "PowerSGD: rank-r factors P, Q summed, warm-started Q, error feedback"
    aggregation = Aggregation.SUM
    rounds = 2
    wants_error_feedback = True
    batches = True

    def __post_init__(self) -> None:
        self.rank = check_positive_int("rank", self.rank)
        self.min_compression = _check_non_negative("min_compression", self.min_compression)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if self.layout not in LAYOUTS:
            raise ValueError(
                f"layout must be one of {', '.join(map(repr, LAYOUTS))}, got {self.layout!r}"
            )
        #: per bucket layout (its shapes, dtype, device), what it keeps from step to step
        self._buckets: dict[tuple, BucketState] = {}
        #: the warm start of every tensor key, stored as Q^T (rank x m)
        self.warm: dict[str, Tensor] = {}
        self._outputs: dict[str, tuple[Tensor, Tensor]] = {}
        #: per group of stacked keys, the last step's stacked Q^T and the views of it that
        #: ``warm`` holds (while they are still the ones there, the stack is reused)
        self._stacked_warm: dict[str, tuple[Tensor, list[Tensor]]] = {}
        #: per key (or stacked group), rows to refill dead rows of its warm start with on
        #: a GPU
        self._spares: dict[str, Tensor] = {}

    def bucket_as_segments(self, device: torch.device) -> bool:
        """Whether a bucket's matrices on ``device`` go as one run (``layout``)."""
        if self.layout == "auto":
            return device.type != "cpu"
        return self.layout == "bucket"

    def exchange_segmented(
        self, flat: Tensor, shapes: Sequence[torch.Size], slots: Sequence[Slot]
    ) -> Exchange:
        """A bucket's matrices side by side in ``flat``, all at once
        (:func:`~thinwire.compress.powersgd_bucket.exchange_bucket`)."""
        key = (tuple(shapes), flat.dtype, flat.device)
        state = self._buckets.get(key)
        if state is None:
            layout = BucketLayout(shapes, self.rank)
            state = BucketState(layout, self._bucket_spare(layout, slots, flat), flat)
            self._buckets[key] = state
        warm_start = self._bucket_warm_start(state, shapes, slots, flat)
        outcome = yield from exchange_bucket(state, flat, warm_start, slots[0].world_size)
        for slot, view in zip(slots, state.warm[1], strict=True):
            self.warm[slot.key] = view
        return outcome

    def _bucket_warm_start(
        self, state: BucketState, shapes: Sequence[torch.Size], slots: Sequence[Slot], flat: Tensor
    ) -> Tensor:
        """Every matrix's warm start side by side: the bucket's last one itself while
        ``warm`` still holds its views (no copy), else put together from ``warm``."""
        if state.warm is not None:
            kept, views = state.warm
            if all(self.warm.get(s.key) is v for s, v in zip(slots, views, strict=True)):
                return kept
        parts = []
        for shape, slot in zip(shapes, slots, strict=True):
            matrix = flat.new_empty(1, 1).expand(shape[0], math.prod(shape) // shape[0])
            parts.append(self._warm_start(slot.key, matrix).reshape(-1))
        return torch.cat(parts)

    def _bucket_spare(self, layout: BucketLayout, slots: Sequence[Slot], like: Tensor) -> Tensor:
        """Seeded random rows for every matrix's warm start, side by side (the same on
        every rank): what refills a dead row."""
        parts = []
        for stack in layout.stacks:
            for slot in slots[stack.first : stack.first + stack.count]:
                seed = stable_seed(self.seed, slot.key, "spare")
                generator = torch.Generator().manual_seed(seed)
                parts.append(torch.randn(stack.r * stack.m, generator=generator, dtype=like.dtype))
        return torch.cat(parts).to(like.device)

    def compresses(self, tensor: Tensor) -> bool:
        """Matrices (and higher) whose factors are ``min_compression`` times smaller."""
        if tensor.dim() < 2 or tensor.numel() == 0:
            return False
        n, m = tensor.shape[0], tensor.numel() // tensor.shape[0]
        return (n + m) * min(self.rank, n, m) * self.min_compression <= n * m

    def exchange(self, tensor: Tensor, slot: Slot) -> Exchange:
        """Sum P, orthogonalize, sum Q; mean = P Q^T / N (see the module docstring)."""
        matrix = tensor.reshape(tensor.shape[0], -1)
        qt = self._warm_start(slot.key, matrix)
        (pt_sum,) = yield Request.sum(qt @ matrix.T)  # P^T = (M Q)^T
        pt = orthonormal_rows(pt_sum)
        qt_local = pt @ matrix  # Q^T = (M^T P)^T
        (qt_sum,) = yield Request.sum(qt_local)
        qt_mean = qt_sum / slot.world_size
        mean, local = self._output_buffers(slot.key, matrix)
        torch.mm(pt.T, qt_mean, out=mean)
        torch.mm(pt.T, qt_local, out=local)
        self.warm[slot.key] = self._revive(qt_mean, slot)
        return Exchanged(mean=mean.view_as(tensor), local=local.view_as(tensor))

    def exchange_stacked(self, stacked: Tensor, slots: Sequence[Slot]) -> Exchange:
        """:meth:`exchange` for same-shaped tensors at once: batched products and one
        batched orthogonalisation (as PyTorch's hook batches same-shaped matrices), the
        same math per tensor, so the results match the one-by-one exchange to rounding."""
        count = stacked.shape[0]
        matrices = stacked.reshape(count, stacked.shape[1], -1)
        group = "\0".join(slot.key for slot in slots)
        qt = self._stacked_warm_start(group, slots, matrices)
        (pt_sum,) = yield Request.sum(torch.bmm(qt, matrices.transpose(1, 2)))
        pt = orthonormal_rows(pt_sum)
        qt_local = torch.bmm(pt, matrices)
        (qt_sum,) = yield Request.sum(qt_local)
        qt_mean = qt_sum / slots[0].world_size
        mean, local = self._output_buffers(group, matrices)
        torch.bmm(pt.transpose(1, 2), qt_mean, out=mean)
        torch.bmm(pt.transpose(1, 2), qt_local, out=local)
        if qt_mean.device.type != "cpu":  # on a GPU without reading anything back
            dead = torch.linalg.vector_norm(qt_mean, math.inf, dim=2, keepdim=True) == 0
            qt_mean = torch.where(dead, self._spare(group, qt_mean), qt_mean)
        elif bool((qt_mean.abs().amax(dim=2) == 0).any()):
            for i, slot in enumerate(slots):
                self._revive(qt_mean[i], slot)
        views = list(qt_mean.unbind(0))
        for slot, view in zip(slots, views, strict=True):
            self.warm[slot.key] = view
        self._stacked_warm[group] = (qt_mean, views)
        return Exchanged(mean=mean.view_as(stacked), local=local.view_as(stacked))

    def _stacked_warm_start(self, group: str, slots: Sequence[Slot], matrices: Tensor) -> Tensor:
        """Each key's warm start, stacked: last step's stack itself while ``warm`` still
        holds its views (no copy), else stacked anew."""
        kept = self._stacked_warm.get(group)
        if kept is not None:
            stack, views = kept
            same = stack.dtype == matrices.dtype and stack.device == matrices.device
            if same and all(self.warm.get(s.key) is v for s, v in zip(slots, views, strict=True)):
                return stack
        return torch.stack([self._warm_start(slot.key, matrices[0]) for slot in slots])

    # -- warm start -----------------------------------------------------------------------

    def _warm_start(self, key: str, matrix: Tensor) -> Tensor:
        """Last step's averaged Q^T, or a seeded random one for a new key or shape."""
        n, m = matrix.shape
        rank = min(self.rank, n, m)
        qt = self.warm.get(key)
        if qt is None or qt.shape != (rank, m):
            generator = torch.Generator().manual_seed(stable_seed(self.seed, key))
            qt = torch.randn(rank, m, generator=generator, dtype=matrix.dtype)
        return qt.to(device=matrix.device, dtype=matrix.dtype)

    def _revive(self, qt: Tensor, slot: Slot) -> Tensor:
        """Refill rows of Q^T that are exactly zero (an all-zero gradient), which power
        iteration could never leave; the same on every rank, since Q^T is. On the CPU
        with rows drawn for the step; on a GPU, where asking whether any row is dead
        would make the host wait, with the key's spare rows (:meth:`_spare`) chosen on the
        device."""
        if qt.device.type != "cpu":
            dead = torch.linalg.vector_norm(qt, math.inf, dim=1, keepdim=True) == 0
            return torch.where(dead, self._spare(slot.key, qt), qt)
        dead = qt.abs().amax(dim=1) == 0
        if bool(dead.any()):
            generator = torch.Generator().manual_seed(stable_seed(self.seed, slot.key, slot.step))
            fresh = torch.randn(qt.shape, generator=generator, dtype=qt.dtype)
            qt[dead] = fresh.to(qt.device)[dead]
        return qt

    def _spare(self, key: str, like: Tensor) -> Tensor:
        """Seeded random rows shaped as ``like`` for the dead rows of ``key`` (a tensor's
        key, or a stacked group's), made once per key, shape, dtype and device (the same
        on every rank)."""
        spare = self._spares.get(key)
        if spare is None or (spare.shape, spare.dtype, spare.device) != (
            like.shape,
            like.dtype,
            like.device,
        ):
            generator = torch.Generator().manual_seed(stable_seed(self.seed, key, "spare"))
            spare = torch.randn(like.shape, generator=generator, dtype=like.dtype)
            spare = self._spares[key] = spare.to(device=like.device)
        return spare

    def _output_buffers(self, key: str, matrix: Tensor) -> tuple[Tensor, Tensor]:
        """The (mean, local) buffers of ``key``, reused across steps."""
        buffers = self._outputs.get(key)
        if (
            buffers is None
            or buffers[0].shape != matrix.shape
            or buffers[0].dtype != (matrix.dtype)
        ):
            buffers = (torch.empty_like(matrix), torch.empty_like(matrix))
            self._outputs[key] = buffers
        return buffers

    # -- checkpointing --------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The warm-start Q^T of every tensor key."""
        return {"warm": {key: qt.clone() for key, qt in self.warm.items()}}

    def snapshot(self) -> dict[str, Any]:
        """The warm starts themselves: an exchange replaces a key's warm start with a new
        tensor and never writes one in place."""
        return {"warm": dict(self.warm)}

    #: a refused step's new warm starts can be put back on the device (:meth:`undo_where`)
    undoes_on_device = True

    def undo_where(self, before: dict[str, Any], refused: Tensor) -> None:
        """Every warm start the step replaced put back (in place) where the device flag
        ``refused`` is set; a key the step saw first gets zeros there (the rows of its
        next exchange's new warm start that stay zero are refilled, as for any gradient
        that was zero)."""
        old = before.get("warm", {})
        changed = [key for key, qt in self.warm.items() if old.get(key) is not qt]
        befores = [
            old[key]
            if key in old and old[key].shape == self.warm[key].shape
            else torch.zeros_like(self.warm[key])
            for key in changed
        ]
        where_many(refused, befores, [self.warm[key] for key in changed])

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the warm starts."""
        unknown = set(state) - {"warm"}
        if unknown:
            raise ValueError(f"compressor 'powersgd' got unknown state {sorted(unknown)}")
        self.warm = {key: qt.clone() for key, qt in state.get("warm", {}).items()}


#: PowerSGD's ways of laying out a bucket's matrices (see ``PowerSGD.layout``)
LAYOUTS = ("auto", "stacks", "bucket")


def orthonormal_rows(matrices: Tensor) -> Tensor:
    """Rows spanning what the rows of ``matrices`` (r x n, or a stack of them) span,
    orthonormal: :func:`orthogonalize_rows` without writing its input (the Q of a
    QR factorisation comes out column-major, so its transpose is contiguous: no copy)."""
    q, _ = torch.linalg.qr(matrices.mT)
    return q.mT


def orthogonalize_rows(matrix: Tensor) -> Tensor:
    """Orthonormalize the rows of ``matrix`` (r x n, r <= n) in place and return it.

    Householder QR of the transpose: the rows come out orthonormal to rounding whatever
    the conditioning, and rank-deficient inputs (dependent or zero rows) get orthonormal
    completions instead of NaN. Modified Gram-Schmidt, even twice, loses orthogonality on
    warm-started factors, whose condition number is roughly that of the gradient squared;
    then ``P P^T`` is no projection and even full-rank PowerSGD is inexact.
    """
    q, _ = torch.linalg.qr(matrix.T)  # n x r, orthonormal columns
    matrix.copy_(q.T)
    return matrix


def _check_non_negative(name: str, value: float) -> float:
    """Validate an option that must be a finite number >= 0, naming it."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
    ):
        raise ValueError(f"{name} must be a number >= 0, got {value!r}")
    return float(value)

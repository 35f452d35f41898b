"""PowerSGD over a whole bucket at once: one orthonormalisation for all its matrices.

Stacked by shape (:meth:`PowerSGD.exchange_stacked`), a bucket of the image task's
ResNet-18 still takes a dozen stacks, each with its own QR. On a GPU each
``torch.linalg.qr`` goes through the solver library with its own launches and workspace
(about 1.9 ms of host time for those 12 stacks on an H200, ``bench/orthonormal_cost.py``),
more than the products themselves. Here the bucket's compressed tensors come as one flat
tensor (a run of segments) and::

    P^T_s   = Q^T_s M^T_s             a batched product per run of same-shaped matrices,
                                      into one flat buffer: one sum for the bucket
    padded  = every P^T, zero-padded to the longest (one copy)
    P^T     = householder_rows(padded)    the QR's Q for all of them, a fixed number
                                          of kernels (:func:`householder_rows`)
    Q^T_s   = P^T_s M_s               into one flat buffer: one sum
    mean_s  = P_s (sum Q^T_s)^T / N,  local_s = P_s Q^T_s      into flat outputs
    dead rows of the new warm start refilled from spare rows, for all rows at once

The arithmetic is PowerSGD's; the orthonormal factor is Householder's, as LAPACK's QR
computes it (equal to rounding, not to the bit), so a run differs from the stacked one in
its last bits. The CPU keeps the stacked path; GPUs take this one (``PowerSGD.layout``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from thinwire.compress.base import Exchange, Exchanged, Request
from thinwire.compress.segments import Segments


def householder_rows(rows: Tensor) -> Tensor:
    """Orthonormal rows spanning each stack's rows: for ``rows`` of shape (B, r, n) with
    r <= n, the transposed Q of the Householder QR of each ``rows[b]^T``, as
    ``torch.linalg.qr`` gives it (LAPACK's reflectors and signs, equal to rounding; where
    a column has nothing below its diagonal LAPACK leaves it and this reflects it, a sign
    that PowerSGD's products do not see), in a fixed number of kernels per rank (about
    15) whatever B. Zero or dependent rows get orthonormal completions, not NaN.
    Writes ``rows`` (the reflected remainder is left there)."""
    batch, rank, n = rows.shape
    if rank > n:
        raise ValueError(f"householder_rows needs rows no more than columns, got {rank} x {n}")
    below = _below_masks(rank, n, rows.dtype, rows.device)
    tiny = torch.finfo(rows.dtype).tiny
    reflectors = []
    for j in range(rank):
        x = rows[:, j, :] * below[j]  # the column's entries from the diagonal down
        # scaled to a largest entry of 1 first: squares of gradient-sized values (1e-20
        # and less, or 1e20 and more) would underflow or overflow the norm
        x /= torch.linalg.vector_norm(x, math.inf, dim=1, keepdim=True).clamp_min(tiny)
        norm = torch.linalg.vector_norm(x, dim=1, keepdim=True)
        beta = torch.copysign(norm, x[:, j : j + 1])
        x[:, j : j + 1] += beta  # x - beta' e_j, beta' = -sign(x_j) |x|: no cancellation
        u = x / torch.linalg.vector_norm(x, dim=1, keepdim=True).clamp_min(tiny)
        reflectors.append(u)
        if j + 1 < rank:  # reflect the columns still to come
            rest = rows[:, j + 1 :, :]
            rest.baddbmm_(torch.bmm(rest, u.unsqueeze(2)), u.unsqueeze(1), alpha=-2.0)
    q = _identity_rows(rank, n, rows.dtype, rows.device).repeat(batch, 1, 1)
    for u in reversed(reflectors):  # Q = H_0 H_1 ... H_{r-1} applied to e_0 .. e_{r-1}
        q.baddbmm_(torch.bmm(q, u.unsqueeze(2)), u.unsqueeze(1), alpha=-2.0)
    return q


_CONSTANTS: dict[tuple, Tensor] = {}


def _below_masks(rank: int, n: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Row j: 1 from position j on, 0 before (made once per shape, dtype and device)."""
    key = ("below", rank, n, dtype, device)
    mask = _CONSTANTS.get(key)
    if mask is None:
        positions = torch.arange(n)
        mask = (positions >= torch.arange(rank).unsqueeze(1)).to(dtype=dtype, device=device)
        _CONSTANTS[key] = mask
    return mask


def _identity_rows(rank: int, n: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    key = ("eye", rank, n, dtype, device)
    eye = _CONSTANTS.get(key)
    if eye is None:
        eye = _CONSTANTS[key] = torch.eye(rank, n, dtype=dtype, device=device).unsqueeze(0)
    return eye


@dataclass(frozen=True)
class Stack:
    """A run of ``count`` adjacent same-shaped matrices (n x m, factors of rank r) of a
    bucket, from member ``first``; where its values, P^T and Q^T lie in the flat
    tensors, and its first row in the padded P^T stack."""

    first: int
    count: int
    n: int
    m: int
    r: int
    values_at: int
    p_at: int
    q_at: int
    padded_row: int


class BucketLayout:
    """Where each matrix of a bucket's compressed tensors (of ``shapes``, side by side)
    goes in one PowerSGD step at ``rank``: its stack, the flat P^T and Q^T buffers, the
    padded P^T stack. Made once per layout; its index tensors moved once per device."""

    def __init__(self, shapes: Sequence[torch.Size], rank: int) -> None:
        matrices = [(shape[0], math.prod(shape) // shape[0]) for shape in shapes]
        stacks: list[Stack] = []
        values = p = q = padded = 0
        i = 0
        while i < len(matrices):
            j = i
            while j < len(matrices) and matrices[j] == matrices[i]:
                j += 1
            n, m = matrices[i]
            r = min(rank, n, m)
            stacks.append(Stack(i, j - i, n, m, r, values, p, q, padded))
            values += (j - i) * n * m
            p += (j - i) * r * n
            q += (j - i) * r * m
            padded += j - i
            i = j
        self.stacks = stacks
        self.numel, self.p_numel, self.q_numel = values, p, q
        self.padded_shape = (padded, max(s.r for s in stacks), max(s.n for s in stacks))
        _, width_r, width_n = self.padded_shape
        places = [
            ((s.padded_row + c) * width_r + row) * width_n + torch.arange(s.n)
            for s in stacks
            for c in range(s.count)
            for row in range(s.r)
        ]
        self._places = torch.cat(places)
        #: one segment per row of Q^T (each matrix's r rows of length m), for dead rows
        self.q_rows = Segments([s.m for s in stacks for _ in range(s.count * s.r)])
        self._on: dict[torch.device, Tensor] = {}

    def places(self, device: torch.device) -> Tensor:
        """Where each value of the flat P^T goes in the padded stack, on ``device``."""
        moved = self._on.get(device)
        if moved is None:
            moved = self._on[device] = self._places.to(device)
        return moved

    def values(self, flat: Tensor) -> list[Tensor]:
        """Each stack's matrices in ``flat`` (a bucket's values): count x n x m views."""
        return _split(flat, [(s.count, s.n, s.m) for s in self.stacks])

    def p(self, flat: Tensor) -> list[Tensor]:
        """Each stack's P^T in a flat P^T buffer: count x r x n views."""
        return _split(flat, [(s.count, s.r, s.n) for s in self.stacks])

    def q(self, flat: Tensor) -> list[Tensor]:
        """Each stack's Q^T in a flat Q^T buffer: count x r x m views."""
        return _split(flat, [(s.count, s.r, s.m) for s in self.stacks])

    def orthonormal(self, padded: Tensor) -> list[Tensor]:
        """Each stack's orthonormal P^T in the padded stack: count x r x n views."""
        rows = padded.split([s.count for s in self.stacks])
        return [part[:, : s.r, : s.n] for part, s in zip(rows, self.stacks, strict=True)]

    def q_views(self, flat: Tensor) -> list[Tensor]:
        """Each matrix's Q^T (r x m) in a flat Q^T buffer, in the members' order."""
        return _split(flat, [(s.r, s.m) for s in self.stacks for _ in range(s.count)])


def _split(flat: Tensor, shapes: list[tuple[int, ...]]) -> list[Tensor]:
    """``flat`` cut into consecutive views of ``shapes``."""
    parts = flat.split([math.prod(shape) for shape in shapes])
    return [part.view(shape) for part, shape in zip(parts, shapes, strict=True)]


class BucketState:
    """What one bucket layout keeps from step to step: its output buffers (overwritten
    by the next step, as the stacked path's), the spare rows that refill dead rows of a
    warm start, and the last warm start with the per-matrix views of it that
    ``PowerSGD.warm`` holds."""

    def __init__(self, layout: BucketLayout, spare: Tensor, like: Tensor) -> None:
        self.layout = layout
        self.mean = like.new_empty(layout.numel)
        self.local = like.new_empty(layout.numel)
        #: each stack's part of the outputs
        self.means, self.locals = layout.values(self.mean), layout.values(self.local)
        self.spare = spare
        self.warm: tuple[Tensor, list[Tensor]] | None = None


def exchange_bucket(
    state: BucketState, flat: Tensor, warm_start: Tensor, world_size: int
) -> Exchange:
    """One PowerSGD step for a bucket's compressed tensors side by side in ``flat``
    (``warm_start``: every matrix's Q^T side by side; see the module docstring). Returns
    the flat mean and local approximation, and leaves the new warm start (summed Q^T
    over ranks, divided, dead rows refilled) in ``state.warm``."""
    layout = state.layout
    matrices = layout.values(flat)
    pts = flat.new_empty(layout.p_numel)
    for qt, values, pt in zip(layout.q(warm_start), matrices, layout.p(pts), strict=True):
        torch.bmm(qt, values.transpose(1, 2), out=pt)
    (pt_sum,) = yield Request.sum(pts)
    padded = pt_sum.new_zeros(layout.padded_shape)
    padded.view(-1).index_copy_(0, layout.places(flat.device), pt_sum)
    orthonormal = layout.orthonormal(householder_rows(padded))
    qts = flat.new_empty(layout.q_numel)
    qt_locals = layout.q(qts)
    for pt, values, qt in zip(orthonormal, matrices, qt_locals, strict=True):
        torch.bmm(pt, values, out=qt)
    (qt_sum,) = yield Request.sum(qts)
    qt_mean = qt_sum / world_size
    outputs = zip(orthonormal, layout.q(qt_mean), qt_locals, state.means, state.locals, strict=True)
    for pt, qt_mean_part, qt_local, mean, local in outputs:
        torch.bmm(pt.transpose(1, 2), qt_mean_part, out=mean)
        torch.bmm(pt.transpose(1, 2), qt_local, out=local)
    # rows of the new warm start that are exactly zero (an all-zero gradient) would stay
    # zero for good: refill them from the spare rows, on the device
    rows = layout.q_rows
    dead = rows.expand(rows.max(qt_mean.abs()) == 0)
    qt_mean = torch.where(dead, state.spare, qt_mean)
    state.warm = (qt_mean, layout.q_views(qt_mean))
    return Exchanged(mean=state.mean, local=state.local)

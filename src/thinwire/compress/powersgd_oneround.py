"""PowerSGD in one round per step: project onto last step's factors, on both sides.

PowerSGD sums ``P = M Q``, orthogonalises it, then sums ``Q = M^T P``: two rounds per step,
the second waiting for the first, so a bucket's exchange costs two all-reduce latencies and
the last bucket's both come after the backward pass. Here every rank projects its M onto
two subspaces all ranks agreed on at the previous step, a column basis C (rank x n) and a
row basis R (rank x m), both with orthonormal rows, and one sum carries both coordinates.
With M the tensor as a matrix (error feedback already added)::

    X = C M        (rank x m)        Y = R M^T      (rank x n)        one sum of both
    Pi(M) = C^T C M + M R^T R - C^T C M R^T R  =  C^T X + Y^T R - C^T (X R^T) R
    mean   = Pi of the sums / N       local = Pi of this rank's X, Y   residual = M - local
    next C = orthogonalize(sum of Y)           next R = orthogonalize(sum of X)

Pi is the orthogonal projection that keeps everything of M but ``(I - C^T C) M (I - R^T R)``;
Pi(M) has rank <= 2 * rank. Pi is linear, so ``mean`` is the average of the ranks'
``local`` s, the coordinates sum, and error feedback keeps what it leaves out. The next
bases are PowerSGD's P and Q computed from the summed coordinates (P from ``M R^T``, Q from
``M^T C``): each step runs one step of power iteration, as PowerSGD does, but projects onto
the previous step's result where PowerSGD waits a round for this step's. For a fixed M the
bases converge to its top singular subspaces and Pi(M) to its best rank-r approximation.
Bytes: ``(n + m) * rank`` numbers, as PowerSGD's two rounds together.

``alternate``: only one side per exchange, C and R in turns (tensors start on alternate
sides, by key): half the bytes, but the subspace then moves half as fast and is stale on
one side; measured much worse (docs/measurements.md, "PowerSGD in one round").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from thinwire.compress.base import Exchange, Exchanged, Request, Slot
from thinwire.compress.powersgd import PowerSGD, orthogonalize_rows
from thinwire.compress.randomk import stable_seed
from thinwire.compress.registry import register_compressor


@dataclass
class Bases:
    """A tensor's subspaces for its next exchange, orthonormal rows each: ``columns`` (C,
    rank x n) and ``rows`` (R, rank x m); ``columns_next``: alternating, whether the next
    exchange projects onto C (else onto R)."""

    columns: Tensor
    rows: Tensor
    columns_next: bool = True


@register_compressor
@dataclass
class OneRoundPowerSGD(PowerSGD):
    """Rank-r PowerSGD in one all-reduce a step, onto last step's P and Q; use with error
    feedback (the default).

    Options (``rank``, ``min_compression``, ``seed`` as :class:`PowerSGD`'s):
        rank: the dimension of each basis, an integer >= 1.
        min_compression: send a tensor dense unless ``n*m >= (n + m) * rank *
            min_compression``; 0 compresses every matrix.
        seed: seeds every tensor's first bases (and, alternating, its first side).
        alternate: project onto one side per exchange, in turns (half the bytes).
    """

    alternate: bool = False

    name = "powersgd-oneround"
    summary = "PowerSGD in one round: project onto last step's P and Q, error feedback"
    rounds = 1
    #: one tensor at a time: PowerSGD's stacked and bucket-wide exchanges are its two rounds
    batches = False

    def bucket_as_segments(self, device: torch.device) -> bool:
        """Never: its bases are kept and projected one tensor at a time."""
        return False

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.alternate, bool):
            raise ValueError(f"alternate must be true or false, got {self.alternate!r}")
        #: every tensor key's bases for its next exchange
        self.bases: dict[str, Bases] = {}

    def exchange(self, tensor: Tensor, slot: Slot) -> Exchange:
        """Sum the coordinates on C and R, project, turn the sums into the next bases."""
        matrix = tensor.reshape(tensor.shape[0], -1)
        bases = self._bases(slot.key, matrix)
        c, r = bases.columns, bases.rows
        use_c = bases.columns_next or not self.alternate
        use_r = not bases.columns_next or not self.alternate
        x = c @ matrix if use_c else None  # X = C M
        y = r @ matrix.T if use_r else None  # Y = R M^T
        sums = yield Request.sum(*(t for t in (x, y) if t is not None))
        x_sum = sums[0] if use_c else None
        y_sum = sums[-1] if use_r else None
        mean, local = self._output_buffers(slot.key, matrix)
        _project(mean, c, x_sum, r, y_sum).div_(slot.world_size)
        _project(local, c, x, r, y)
        self.bases[slot.key] = Bases(
            orthogonalize_rows(y_sum.clone()) if y_sum is not None else c,
            orthogonalize_rows(x_sum.clone()) if x_sum is not None else r,
            not bases.columns_next,
        )
        return Exchanged(mean=mean.view_as(tensor), local=local.view_as(tensor))

    def _bases(self, key: str, matrix: Tensor) -> Bases:
        """The bases of ``key``, or seeded random ones for a new key or shape."""
        n, m = matrix.shape
        rank = min(self.rank, n, m)
        bases = self.bases.get(key)
        if bases is None or bases.columns.shape != (rank, n) or bases.rows.shape != (rank, m):
            generator = torch.Generator().manual_seed(stable_seed(self.seed, key))
            columns = orthogonalize_rows(torch.randn(rank, n, generator=generator))
            rows = orthogonalize_rows(torch.randn(rank, m, generator=generator))
            bases = Bases(columns, rows, stable_seed(self.seed, key, "side") % 2 == 0)
        like = {"device": matrix.device, "dtype": matrix.dtype}
        return Bases(bases.columns.to(**like), bases.rows.to(**like), bases.columns_next)

    # -- checkpointing --------------------------------------------------------------------

    #: its bases alternate sides on the host: a refused step is read there (one wait)
    undoes_on_device = False

    def snapshot(self) -> dict[str, Any]:
        """A copy of the bases (:meth:`state_dict`), not PowerSGD's warm starts."""
        return self.state_dict()

    def state_dict(self) -> dict[str, Any]:
        """Every tensor key's bases and, alternating, the side it sends next."""
        return {
            "bases": {
                key: {
                    "columns": b.columns.clone(),
                    "rows": b.rows.clone(),
                    "columns_next": b.columns_next,
                }
                for key, b in self.bases.items()
            }
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the bases."""
        unknown = set(state) - {"bases"}
        if unknown:
            raise ValueError(f"compressor {self.name!r} got unknown state {sorted(unknown)}")
        self.bases = {
            key: Bases(entry["columns"].clone(), entry["rows"].clone(), bool(entry["columns_next"]))
            for key, entry in state.get("bases", {}).items()
        }


def _project(out: Tensor, c: Tensor, x: Tensor | None, r: Tensor, y: Tensor | None) -> Tensor:
    """Write ``C^T X + Y^T R - C^T (X R^T) R`` into ``out`` (the terms of a side that was
    not sent left out) and return it."""
    if x is not None:
        torch.mm(c.T, x, out=out)
        if y is not None:
            out.addmm_(y.T, r)
            out.addmm_(c.T @ (x @ r.T), r, alpha=-1.0)
    elif y is not None:
        torch.mm(y.T, r, out=out)
    return out

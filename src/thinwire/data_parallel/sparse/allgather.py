"""The sparse all-gather baseline: a replicated table whose gradient travels as
(row ids, row gradients) pairs.

Every rank holds the whole ``V x D`` table, so a lookup is local. Its backward pass sums the
gradient of each distinct id the batch used (``u`` rows), and every rank all-gathers every
other rank's ``u`` ids and ``u x D`` gradients, then adds them all (divided by W, as DDP
averages) into a full-table gradient: each rank ends the step with the same gradient DDP's
dense all-reduce would have produced, having moved only looked-up rows. What it costs grows
with the number of ranks (each rank receives every other rank's rows), where the sharded
table's all-to-all sends each row to one owner only; this is the baseline
:class:`~thinwire.data_parallel.sparse.ShardedEmbedding` is measured against, beside plain DDP.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from thinwire.comm.collectives import run_collective, sibling_group
from thinwire.data_parallel.parameters import TABLE_MARK
from thinwire.data_parallel.sparse.embedding import (
    SparseTraffic,
    agree_on_table,
    check_ids,
    check_table,
)


class AllGatherEmbedding(nn.Module):
    """``nn.Embedding(num_embeddings, embedding_dim)`` replicated on every rank of
    ``group``, its gradient exchanged as all-gathered (ids, rows) (see the module
    docstring). Forward is local; backward is a collective.

    Args:
        num_embeddings: V, the number of rows.
        embedding_dim: D.
        group: the data-parallel process group (default: the global one).
        seed: the table is drawn from N(0, 1) with this seed (the same on every rank).
        sparse_grad: give ``weight`` a sparse gradient (the rows any rank touched), for
            ``torch.optim.SparseAdam``; default: dense, for any optimizer.
        overlap: carry the gathers on a process group of their own (created here: a
            collective of every rank of the default group), beside DDP's and a thinwire
            compressor's traffic on ``group`` rather than interleaved with it.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        group: dist.ProcessGroup | None = None,
        seed: int = 0,
        sparse_grad: bool = False,
        overlap: bool = True,
    ) -> None:
        super().__init__()
        check_table(num_embeddings, embedding_dim)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.group = group
        self.world = dist.get_world_size(group)
        self.sparse_grad = sparse_grad
        self.overlap, self.seed = overlap, seed
        # replicas drawn from different seeds would differ for good, without an error
        # (compared modulo 2**62: torch takes seeds up to 2**64 - 1)
        self._seed_key = seed % 2**62
        agree_on_table(
            self,
            ("num_embeddings", "embedding_dim", "overlap", "sparse_grad", "_seed_key"),
            "all-gather tables",
        )
        self._group = sibling_group(group) if overlap else group
        generator = torch.Generator().manual_seed(seed)
        self.weight = nn.Parameter(torch.randn(num_embeddings, embedding_dim, generator=generator))
        setattr(self.weight, TABLE_MARK, True)  # wrappers leave it alone
        self.traffic = SparseTraffic()

    def forward(self, ids: Tensor) -> Tensor:
        """Embedding vectors of ``ids`` (integer tensor of any shape): ``ids.shape + (D,)``."""
        flat = check_ids(ids, self.num_embeddings)
        unique, inverse = torch.unique(flat, sorted=True, return_inverse=True)
        out = _GatherLookup.apply(self.weight, unique, inverse, self)
        return out.view(*ids.shape, self.embedding_dim)

    def gather_rows(self, unique: Tensor, grads: Tensor) -> tuple[Tensor, Tensor]:
        """Every rank's (ids, row gradients), concatenated in rank order (collective)."""
        count = unique.new_tensor([unique.numel()])
        counts = [torch.empty_like(count) for _ in range(self.world)]
        run_collective(
            "an all-gather table's count exchange",
            dist.all_gather,
            counts,
            count,
            group=self._group,
        )
        sizes = [int(c) for c in counts]
        # one all-gather for ids and rows together: both as raw bytes, any dtype intact
        id_bytes = unique.element_size()
        row_bytes = self.embedding_dim * grads.element_size()
        packed = torch.zeros(
            max(sizes), id_bytes + row_bytes, dtype=torch.uint8, device=grads.device
        )
        packed[: unique.numel(), :id_bytes] = (
            unique.contiguous().view(torch.uint8).view(-1, id_bytes)
        )
        packed[: unique.numel(), id_bytes:] = (
            grads.contiguous().view(torch.uint8).view(-1, row_bytes)
        )
        gathered = [torch.empty_like(packed) for _ in range(self.world)]
        run_collective(
            "an all-gather table's row exchange",
            dist.all_gather,
            gathered,
            packed,
            group=self._group,
        )
        self.traffic.ids = (unique.numel() + 1) * id_bytes
        self.traffic.grads = grads.numel() * grads.element_size()
        every = torch.cat([g[:n] for g, n in zip(gathered, sizes, strict=True)])
        ids = every[:, :id_bytes].contiguous().view(unique.dtype).view(-1)
        rows = every[:, id_bytes:].contiguous().view(grads.dtype).view(-1, self.embedding_dim)
        return ids, rows

    def close(self) -> None:
        """Free the table's own process group (local)."""
        if self._group is not self.group:
            with contextlib.suppress(Exception):  # already gone with the default group
                dist.destroy_process_group(self._group)
            self._group = self.group

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, replicated on {self.world} ranks"


class _GatherLookup(torch.autograd.Function):
    """Forward: a local lookup; backward: all-gather (ids, row gradients), sum them."""

    @staticmethod
    def forward(
        ctx: Any, weight: Tensor, unique: Tensor, inverse: Tensor, table: AllGatherEmbedding
    ) -> Tensor:
        ctx.save_for_backward(unique, inverse)
        ctx.table = table
        return weight.detach().index_select(0, unique).index_select(0, inverse)

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, None, None, None]:
        unique, inverse = ctx.saved_tensors
        table: AllGatherEmbedding = ctx.table
        per_unique = grad_out.new_zeros(unique.numel(), table.embedding_dim)
        per_unique.index_add_(0, inverse, grad_out.reshape(-1, table.embedding_dim))
        per_unique.div_(table.world)
        ids, rows = table.gather_rows(unique, per_unique)
        shape = table.weight.shape
        if table.sparse_grad:
            grad = torch.sparse_coo_tensor(ids.unsqueeze(0), rows, shape).coalesce()
        else:
            grad = grad_out.new_zeros(shape).index_add_(0, ids, rows)
        return grad, None, None, None

"""An embedding table whose rows are spread over the data-parallel ranks (EmbRace-style).

Row ``r`` of a ``V x D`` table lives on rank ``r % W`` (W ranks), as local row ``r // W``:
cyclic, so that frequent low ids (a sorted vocabulary) spread over every rank. A lookup::

    ids (any shape)  ->  unique ids u (sorted), inverse map
                     ->  grouped by owner; counts exchanged (all_to_all_single of W ints)
                     ->  ids to their owners (all_to_all_single, uneven splits)
                     ->  owners gather their rows, send the vectors back (all_to_all_single)
                     ->  out = rows[inverse]

and its backward pass sends each unique id's summed gradient back to the owner the same
way, which accumulates the gradients of every rank that looked the row up. Each rank's
gradient is divided by W, as DDP averages: with each rank's loss a mean over its own
equal-sized batch, the owner's gradient is the gradient of the global batch's mean loss,
and the table trains exactly as one ``nn.Embedding`` would on the global batch. Only looked
up rows travel, each once per rank and step however often the batch repeats it.

The schedule (``overlap=True``, the default) keeps the table's traffic off the critical
path where it can and never queues it behind the dense gradients::

    step t:   forward(ids_t)        route_t was exchanged during step t-1; rows fetched now
              prefetch(ids_t+1)     counts + ids of the next batch, on a background thread
              backward              head buckets: DDP's all-reduce (its own process group)
                                    table: row gradients to their owners, at the same time
              optimizer.step()      every owner updates its rows

Three process groups of the same ranks carry the three streams: DDP's (the data-parallel
group), the lookups' (rows and row gradients, in program order on the training thread) and
the prefetch's (the next batch's ids, on the prefetch thread), so gloo runs them side by
side instead of one behind another. What is needed first goes first: the next forward's ids
leave as soon as the batch is known (a step ahead), the rows leave the moment the forward
asks for them (they cannot leave earlier: the last step's update must land first), and the
row gradients leave as soon as autograd reaches the table, beside the dense all-reduce that
DDP started earlier in the backward pass.

Every rank must call forward, backward and :meth:`ShardedEmbedding.prefetch` the same
number of times in the same order (they are collectives). Dense parameters stay data
parallel (DDP or a thinwire compressor);
:func:`thinwire.data_parallel.sparse.shard_embeddings` tells DDP to leave the tables alone,
since each rank's shard differs by design.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from thinwire.comm.agreement import value_ranges
from thinwire.comm.collectives import run_collective, sibling_group
from thinwire.compress.base import is_integer
from thinwire.data_parallel.parameters import TABLE_MARK
from thinwire.errors import RankMismatchError


@dataclass
class Route:
    """Where one batch's unique ids go: ``unique`` (sorted), ``inverse`` (position of each
    looked-up id in ``unique``), ``order`` (unique positions grouped by owner),
    ``send_counts``/``recv_counts`` (ids per peer), ``served`` (local rows this rank
    serves, in arrival order), ``id_bytes`` (what this rank sent to route them)."""

    unique: Tensor
    inverse: Tensor
    order: Tensor
    send_counts: list[int]
    recv_counts: list[int]
    served: Tensor
    id_bytes: int


@dataclass
class SparseTraffic:
    """Payload bytes this rank handed to its collectives in its last forward and backward
    pass, its share for itself included (headers and how a collective forwards data are
    not counted: the wire's bytes are the network counters' business). For a sharded
    table: the deduplicated ids and counts, the rows it served, the row gradients it
    returned; for the all-gather baseline: its ids and row gradients once, although the
    all-gather delivers them to each of the W - 1 other ranks."""

    ids: int = 0
    rows: int = 0
    grads: int = 0

    @property
    def total(self) -> int:
        """All three together."""
        return self.ids + self.rows + self.grads


def check_table(num_embeddings: int, embedding_dim: int) -> None:
    """Raise, saying what to do, unless a distributed table of this shape can be built."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialised: call "
            "torch.distributed.init_process_group(...) first (or launch with torchrun)"
        )
    for name, value in (("num_embeddings", num_embeddings), ("embedding_dim", embedding_dim)):
        if not is_integer(value) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


#: rows drawn per call while a shard is initialised (a multiple of 16: see ``initial_shard``)
INIT_CHUNK_ROWS = 1 << 14


def initial_shard(
    num_embeddings: int,
    embedding_dim: int,
    seed: int,
    rank: int,
    world: int,
    chunk_rows: int = INIT_CHUNK_ROWS,
) -> Tensor:
    """Rows ``rank, rank + world, ...`` of ``torch.randn(num_embeddings, embedding_dim)``
    drawn with ``seed``, without ever holding the whole table: it is drawn ``chunk_rows``
    rows at a time from one generator, keeping this rank's rows of each chunk.

    The values are the whole table's: torch's CPU generator fills a tensor 16 numbers at
    a time (redrawing the last 16 if the size is not a multiple), so drawing it in pieces
    whose sizes are multiples of 16, the last one at least 16 numbers, gives the same
    stream. ``chunk_rows`` must be a positive multiple of 16.
    """
    if chunk_rows <= 0 or chunk_rows % 16:
        raise ValueError(f"chunk_rows must be a positive multiple of 16, got {chunk_rows}")
    generator = torch.Generator().manual_seed(seed)
    shard = torch.empty(len(range(rank, num_embeddings, world)), embedding_dim)
    start, kept = 0, 0
    while start < num_embeddings:
        end = min(start + chunk_rows, num_embeddings)
        if (num_embeddings - end) * embedding_dim < 16:  # no short last piece
            end = num_embeddings
        chunk = torch.randn(end - start, embedding_dim, generator=generator)
        mine = chunk[(rank - start) % world :: world]
        shard[kept : kept + len(mine)] = mine
        kept += len(mine)
        start = end
    return shard


def check_ids(ids: Tensor, num_embeddings: int) -> Tensor:
    """``ids`` flattened to int64, or an error naming what is wrong with them."""
    if ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
        raise TypeError(f"ids must be an integer tensor, got dtype {ids.dtype}")
    flat = ids.reshape(-1).to(torch.int64)
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= num_embeddings):
        raise IndexError(
            f"ids must lie in [0, {num_embeddings}); got values from "
            f"{int(flat.min())} to {int(flat.max())}"
        )
    return flat


class ShardedEmbedding(nn.Module):
    """``nn.Embedding(num_embeddings, embedding_dim)`` sharded by rows over the ranks of
    ``group`` (see the module docstring). ``weight`` is this rank's shard: global rows
    ``rank, rank + W, rank + 2W, ...``.

    Args:
        num_embeddings: V, the number of rows.
        embedding_dim: D.
        group: the data-parallel process group (default: the global one).
        seed: the full table is drawn from N(0, 1) with this seed, as ``nn.Embedding``
            initialises, and each rank keeps its rows (so any world size starts from the
            same table); it is drawn in pieces (:func:`initial_shard`), so no rank ever
            holds more than its shard and one piece, however large the table.
        sparse_grad: give ``weight`` a sparse gradient (rows touched by any rank only), for
            ``torch.optim.SparseAdam`` or sparse-aware SGD; default: a dense gradient, for
            any optimizer (untouched rows get zero gradient, as in ``nn.Embedding``).
        overlap: carry lookups and prefetches on process groups of their own (created
            here: a collective of every rank of the default group), so that they run beside
            DDP's all-reduce and :meth:`prefetch` can work in the background; ``False``:
            everything on ``group``, in program order from the training thread (do not
            combine with anything that issues collectives on ``group`` from another thread,
            such as a thinwire compressor's DDP hook: ranks could interleave them
            differently).

    ``state_dict()`` holds this rank's rows, marked with the rank and world size they
    belong to; :func:`thinwire.data_parallel.sparse.full_state_dict` writes the whole table,
    which loads on any number of ranks. Call :meth:`close` to free the table's process groups and
    prefetch thread when done (``dense_embeddings`` does).
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
        self.rank = dist.get_rank(group)
        self.sparse_grad = sparse_grad
        self.overlap = overlap
        agree_on_table(
            self, ("num_embeddings", "embedding_dim", "overlap", "sparse_grad"), "sharded tables"
        )
        if overlap:
            self._lookup_group = sibling_group(group)
            self._prefetch_group = sibling_group(group)
        else:
            self._lookup_group = self._prefetch_group = group
        self.weight = nn.Parameter(
            initial_shard(num_embeddings, embedding_dim, seed, self.rank, self.world)
        )
        setattr(self.weight, TABLE_MARK, True)  # wrappers leave it alone
        self.traffic = SparseTraffic()
        self._prefetcher: ThreadPoolExecutor | None = None
        self._pending: tuple[Tensor, Future[Route]] | None = None
        self.register_state_dict_post_hook(_mark_shard)

    def close(self) -> None:
        """Stop the prefetch thread and free the table's own process groups (local)."""
        if self._prefetcher is not None:
            self._prefetcher.shutdown(wait=True)
            self._prefetcher = None
        if self.overlap:
            for group in (self._lookup_group, self._prefetch_group):
                with contextlib.suppress(Exception):  # already gone with the default group
                    dist.destroy_process_group(group)
            self.overlap = False
            self._lookup_group = self._prefetch_group = self.group

    # -- the lookup ---------------------------------------------------------------------

    def forward(self, ids: Tensor) -> Tensor:
        """Embedding vectors of ``ids`` (integer tensor of any shape): ``ids.shape + (D,)``.

        If :meth:`prefetch` was called, ``ids`` must be the ids it was given: the routes
        are already exchanged, and a rank that routed again would issue collectives the
        others do not. A rank given other ids still takes part in the row exchange of the
        prefetched route, with a flag that tells every rank, and then every rank raises:
        this one that its ids differ, the others which rank's did.
        """
        flat = check_ids(ids, self.num_embeddings)
        mismatch = False
        if self._pending is not None:
            expected, future = self._pending
            self._pending = None
            route = future.result()  # re-raises what failed on the prefetch thread
            mismatch = not torch.equal(expected, flat)
        else:
            route = self.route(flat, self._lookup_group)
        self.traffic = SparseTraffic(ids=route.id_bytes)
        out = _Lookup.apply(self.weight, route, self, mismatch)
        return out.view(*ids.shape, self.embedding_dim)

    def prefetch(self, ids: Tensor) -> None:
        """Start routing the next lookup's ``ids`` in the background (deduplicate, exchange
        counts and ids) while this step computes; the next :meth:`forward` must get the
        same ids. A collective: every rank prefetches before the same forward."""
        if not self.overlap:
            raise RuntimeError(
                "ShardedEmbedding(overlap=False) has no background process group to prefetch "
                "on; build it with overlap=True"
            )
        if self._pending is not None:
            raise RuntimeError(
                "ShardedEmbedding: a prefetch is already waiting for its forward; call "
                "forward with its ids before prefetching the next batch"
            )
        flat = check_ids(ids, self.num_embeddings).clone()
        if self._prefetcher is None:
            self._prefetcher = ThreadPoolExecutor(1, thread_name_prefix="thinwire-prefetch")
        self._pending = (flat, self._prefetcher.submit(self.route, flat, self._prefetch_group))

    def route(self, flat_ids: Tensor, group: dist.ProcessGroup | None = None) -> Route:
        """Deduplicate ``flat_ids``, group them by owner and exchange them (collective on
        ``group``, default: the table's)."""
        group = group if group is not None else self.group
        unique, inverse = torch.unique(flat_ids, sorted=True, return_inverse=True)
        owners = unique % self.world
        order = torch.argsort(owners, stable=True)
        send = torch.bincount(owners, minlength=self.world)
        recv = torch.empty_like(send)
        run_collective(
            "a sharded table's id-count exchange", dist.all_to_all_single, recv, send, group=group
        )
        send_counts, recv_counts = send.tolist(), recv.tolist()
        wanted = unique.new_empty(sum(recv_counts))
        run_collective(
            "a sharded table's id exchange",
            dist.all_to_all_single,
            wanted,
            unique[order],
            recv_counts,
            send_counts,
            group=group,
        )
        id_bytes = (unique.numel() + self.world) * 8
        served = wanted // self.world
        return Route(unique, inverse, order, send_counts, recv_counts, served, id_bytes)

    def fetch_rows(
        self, rows: Tensor, send_counts: list[int], recv_counts: list[int], mismatch: bool
    ) -> Tensor:
        """The forward's row exchange (:meth:`exchange_rows`), each rank's rows to each
        peer followed by one status row: 1 where ``mismatch`` (this rank's forward got
        other ids than its prefetch), else 0. Raises on every rank if any rank's status
        is 1, after the exchange, so no rank is left waiting in it."""
        status = rows.new_full((1, self.embedding_dim), float(mismatch))
        outgoing = torch.cat(
            [part for chunk in rows.split(send_counts) for part in (chunk, status)]
        )
        incoming = self.exchange_rows(
            outgoing, [n + 1 for n in send_counts], [n + 1 for n in recv_counts]
        )
        chunks = incoming.split([n + 1 for n in recv_counts])
        flagged = [rank for rank, chunk in enumerate(chunks) if bool(chunk[-1, 0] != 0)]
        if mismatch:
            raise RuntimeError(
                "ShardedEmbedding: forward got other ids than the last prefetch(); pass "
                "prefetch() exactly the ids of the next lookup (or do not prefetch). The "
                "other ranks were told and raise too."
            )
        if flagged:
            raise RankMismatchError(
                f"ShardedEmbedding: rank(s) {flagged} passed forward other ids than their "
                f"last prefetch() (seen from rank {self.rank}); every rank must pass "
                "prefetch() exactly the ids of its next lookup. No rank used the rows."
            )
        return torch.cat([chunk[:-1] for chunk in chunks])

    def exchange_rows(self, rows: Tensor, send_counts: list[int], recv_counts: list[int]) -> Tensor:
        """``all_to_all_single`` of ``(n, D)`` rows with uneven splits (collective)."""
        out = rows.new_empty(sum(recv_counts), self.embedding_dim)
        run_collective(
            "a sharded table's row exchange",
            dist.all_to_all_single,
            out,
            rows.contiguous(),
            recv_counts,
            send_counts,
            group=self._lookup_group,
        )
        return out

    # -- the whole table ----------------------------------------------------------------

    def rows(self) -> Tensor:
        """The global row ids of this rank's shard."""
        return torch.arange(self.rank, self.num_embeddings, self.world, device=self.weight.device)

    def full_weight(self) -> Tensor:
        """The whole ``V x D`` table, on every rank (collective: an all-gather of shards)."""
        return self.gather_shards(self.weight.detach())

    def load_full_weight(self, full: Tensor) -> None:
        """Take this rank's rows of a whole ``V x D`` table (e.g. saved by
        :meth:`full_weight` on any number of ranks)."""
        with torch.no_grad():
            self.weight.copy_(self.own_rows(full))

    def gather_shards(self, shard: Tensor) -> Tensor:
        """The whole-table form of ``shard``, any tensor laid out like this rank's
        ``weight`` rows (the weight, an optimizer's momentum or moments), on every rank
        (collective: an all-gather of every rank's)."""
        if shard.shape[:1] != self.weight.shape[:1]:
            raise ValueError(
                f"a shard of this table has {self.weight.shape[0]} rows, got a tensor of shape "
                f"{tuple(shard.shape)}"
            )
        counts = [len(range(r, self.num_embeddings, self.world)) for r in range(self.world)]
        mine = shard.new_zeros(max(counts), *shard.shape[1:])
        mine[: shard.shape[0]] = shard
        shards = [torch.empty_like(mine) for _ in range(self.world)]
        run_collective("a sharded table's gather", dist.all_gather, shards, mine, group=self.group)
        full = shard.new_empty(self.num_embeddings, *shard.shape[1:])
        for r, (gathered, count) in enumerate(zip(shards, counts, strict=True)):
            full[r :: self.world] = gathered[:count]
        return full

    def own_rows(self, full: Tensor) -> Tensor:
        """This rank's rows of a whole-table tensor (``V`` rows): the inverse of
        :meth:`gather_shards`, for any number of ranks having saved it."""
        if full.shape[:1] != (self.num_embeddings,) or (
            full.dim() == 2 and full.shape[1] != self.embedding_dim
        ):
            raise ValueError(
                f"a table of shape {tuple(full.shape)} cannot load into a sharded embedding of "
                f"{self.num_embeddings} x {self.embedding_dim}: load whole tables, as "
                "thinwire.data_parallel.sparse.full_state_dict and full_optimizer_state_dict "
                "save them (a "
                "rank's own state_dict() holds only its shard)"
            )
        return full[self.rank :: self.world].clone()

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        """Load either this rank's shard (a state_dict saved on the same number of ranks)
        or the whole table (one from :func:`thinwire.data_parallel.sparse.full_state_dict`,
        saved on any number of ranks, or a plain ``nn.Embedding``'s), keeping this rank's rows."""
        key = prefix + "weight"
        value = state_dict.get(key)
        whole = (self.num_embeddings, self.embedding_dim)
        saved_as = local_metadata.get("thinwire_shard")
        if isinstance(value, Tensor) and tuple(value.shape) == whole and saved_as is None:
            state_dict = {**state_dict, key: self.own_rows(value)}
        elif saved_as is not None and tuple(saved_as) != (self.rank, self.world):
            error_msgs.append(
                f"{key} holds shard {saved_as[0]} of a table sharded over {saved_as[1]} ranks, "
                f"and this is rank {self.rank} of {self.world}: load each rank's own "
                "state_dict, or save with thinwire.data_parallel.sparse.full_state_dict to "
                "change ranks"
            )
            return
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, shard {self.rank} of {self.world} "
            f"({self.weight.shape[0]} rows)"
        )


def _mark_shard(
    module: ShardedEmbedding, state_dict: dict[str, Any], prefix: str, local_metadata: dict
) -> None:
    """Record which shard a state_dict holds (checked when it is loaded)."""
    local_metadata["thinwire_shard"] = [module.rank, module.world]


class _Lookup(torch.autograd.Function):
    """Forward: fetch rows from their owners; backward: send row gradients to them."""

    @staticmethod
    def forward(
        ctx: Any, weight: Tensor, route: Route, table: ShardedEmbedding, mismatch: bool
    ) -> Tensor:
        served = weight.detach().index_select(0, route.served)
        fetched = table.fetch_rows(served, route.recv_counts, route.send_counts, mismatch)
        vectors = torch.empty_like(fetched)
        vectors[route.order] = fetched
        table.traffic.rows = served.numel() * served.element_size()
        ctx.route, ctx.table = route, table
        return vectors.index_select(0, route.inverse)

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, None, None, None]:
        route, table = ctx.route, ctx.table
        per_unique = grad_out.new_zeros(route.unique.numel(), table.embedding_dim)
        per_unique.index_add_(0, route.inverse, grad_out.reshape(-1, table.embedding_dim))
        per_unique.div_(table.world)
        at_owner = table.exchange_rows(
            per_unique.index_select(0, route.order), route.send_counts, route.recv_counts
        )
        table.traffic.grads = per_unique.numel() * per_unique.element_size()
        shape = table.weight.shape
        if table.sparse_grad:
            grad = torch.sparse_coo_tensor(route.served.unsqueeze(0), at_owner, shape).coalesce()
        else:
            grad = grad_out.new_zeros(shape).index_add_(0, route.served, at_owner)
        return grad, None, None, None


def agree_on_table(table: nn.Module, names: tuple[str, ...], kind: str) -> None:
    """Check that every rank builds the same table: the integer or bool attributes
    ``names`` of ``table`` (rows, width, ...: the lookups' messages and process groups
    depend on them), in one all-reduce (:func:`~thinwire.comm.collectives.value_ranges`);
    all ranks raise :class:`~thinwire.RankMismatchError` naming what differs. ``kind``
    names the table in the message. Collective over ``table.group``."""
    mine = [int(getattr(table, name)) for name in names]
    problems = [
        f"{name}={value} here, {lowest} to {highest} over the ranks"
        for name, value, (lowest, highest) in zip(
            names, mine, value_ranges(mine, table.group), strict=True
        )
        if lowest != highest
    ]
    if problems:
        raise RankMismatchError(
            f"ranks build different {kind} (seen from rank {dist.get_rank(table.group)}): "
            f"{'; '.join(problems)}. Every rank must build the same model, with the same "
            "table sizes and options."
        )

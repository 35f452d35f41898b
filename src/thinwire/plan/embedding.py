"""What the embedding methods send: the ids a batch looks up, measured, and the collectives
that carry them (the cost model of ``emb-sharded`` and ``emb-allgather``).

Their traffic depends on the data, not only on the model: a sharded table moves only the
rows a batch looks up. So the ids are measured, as every rank would look them up on its own
batches, with a hook on each ``nn.Embedding``. With ``u`` distinct ids on a rank, ``p`` of
them owned by one given other rank (row ``r`` lives on rank ``r % W``), ``D`` the row
width, fp32 rows and int64 ids, per table and step (``alltoall(S)``: one latency, ``S``
bytes from a rank to all its peers together; see :mod:`thinwire.plan.network`)::

    emb-sharded    routing   counts: alltoall(8 (N-1))   ids: alltoall(8 p (N-1))
                                                         (prefetched: off the path)
                   forward   rows:   alltoall(4 D (p + 1) (N-1))  (a status row per peer)
                   backward  row gradients: alltoall(4 D p (N-1))  (when the table's is ready)
    emb-allgather  backward  counts: allgather(8)   (ids, rows): allgather(u_max (8 + 4 D))

``u_max`` is the largest rank's ``u``: the all-gather pads every rank's part to it. The
rest of the model goes through DDP's buckets (or the method's ``compressor``), as usual.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from thinwire.plan.network import ALLGATHER, ALLTOALL, Collective

ID_BYTES = 8  #: int64 ids
ROW_ELEMENT_BYTES = 4  #: fp32 rows and row gradients


@dataclass(frozen=True)
class TableLookups:
    """How one embedding table is looked up per step, averaged over the profiled steps:
    ``unique`` distinct ids per rank, ``largest`` the largest rank's, ``per_peer`` the
    distinct ids a rank needs from one other rank's shard."""

    name: str  #: the table's weight, as a parameter name (``"embedding.weight"``)
    rows: int
    dim: int
    unique: float
    largest: float
    per_peer: float

    def row_bytes(self) -> int:
        """Bytes of one row (or row gradient)."""
        return self.dim * ROW_ELEMENT_BYTES


def measure_lookups(
    model: nn.Module, batches: Sequence[Sequence[Tensor]], world_size: int
) -> list[TableLookups]:
    """Run ``model`` on ``batches[step][rank]`` (its inputs) and record, for every
    ``nn.Embedding``, the ids each rank looks up at each step (no gradients, no training).
    Tables that the embedding methods refuse (tied weights, ``padding_idx``, ...) are
    refused here too, with the same reason; a table must be looked up once per forward."""
    from thinwire.data_parallel.sparse.convert import check_convertible

    if world_size < 1:
        raise ValueError(f"world size must be >= 1, got {world_size}")
    tables = {
        name: module for name, module in model.named_modules() if isinstance(module, nn.Embedding)
    }
    if not tables:
        raise ValueError(
            "the model has no nn.Embedding layers, so the embedding methods have nothing to "
            "shard: use them with a task that has embedding tables (e.g. packages)"
        )
    owners: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), []).append(name)
    for name, table in tables.items():
        check_convertible(name, table, owners.get(id(table.weight), []))
    seen: dict[str, list[Tensor]] = {name: [] for name in tables}
    handles = [
        module.register_forward_pre_hook(
            lambda _, inputs, name=name: seen[name].append(inputs[0].detach().reshape(-1))
        )
        for name, module in tables.items()
    ]
    counts: dict[str, list[tuple[int, int, float]]] = {name: [] for name in tables}
    try:
        with torch.no_grad():
            for step, step_inputs in enumerate(batches):
                if len(step_inputs) != world_size:
                    raise ValueError(
                        f"each step needs one batch per rank ({world_size}), got {len(step_inputs)}"
                    )
                for rank, inputs in enumerate(step_inputs):
                    for ids in seen.values():
                        ids.clear()
                    model(inputs)
                    for name, ids in seen.items():
                        if len(ids) > 1:
                            raise ValueError(
                                f"embedding {name!r} is looked up {len(ids)} times in one "
                                "forward pass; the cost model takes one lookup per table "
                                "and step: measure this model with thinwire bench"
                            )
                        looked_up = ids[0] if ids else torch.empty(0, dtype=torch.long)
                        counts[name].append(_count(looked_up, world_size, step, rank))
    finally:
        for handle in handles:
            handle.remove()
    return [
        _summarise(f"{name}.weight" if name else "weight", tables[name], counts[name])
        for name in tables
    ]


def _count(ids: Tensor, world_size: int, step: int, rank: int) -> tuple[int, int, float]:
    """(``step``, distinct ids, mean distinct ids owned by each rank other than ``rank``)."""
    unique = torch.unique(ids)
    owners = torch.bincount(unique % world_size, minlength=world_size).tolist()
    others = [n for owner, n in enumerate(owners) if owner != rank]
    return step, int(unique.numel()), statistics.fmean(others) if others else 0.0


def _summarise(
    name: str, table: nn.Embedding, counts: list[tuple[int, int, float]]
) -> TableLookups:
    steps = sorted({step for step, _, _ in counts})
    largest = [max(u for s, u, _ in counts if s == step) for step in steps]
    return TableLookups(
        name=name,
        rows=table.num_embeddings,
        dim=table.embedding_dim,
        unique=statistics.fmean(u for _, u, _ in counts),
        largest=statistics.fmean(largest),
        per_peer=statistics.fmean(p for _, _, p in counts),
    )


@dataclass(frozen=True)
class TableTraffic:
    """One step's collectives of the embedding tables: ``forward`` on the forward pass's
    critical path, ``backward`` once the tables' gradients are ready, ``background``
    alongside the step (the prefetched routing of the next batch)."""

    forward: tuple[Collective, ...]
    backward: tuple[Collective, ...]
    background: tuple[Collective, ...]


def table_traffic(
    kind: str, tables: Sequence[TableLookups], options: dict[str, Any], world_size: int
) -> TableTraffic:
    """The collectives of ``kind`` (``"emb-sharded"`` or ``"emb-allgather"``) for
    ``tables`` on ``world_size`` ranks (see the module docstring); ``options``: the
    method's (``prefetch``, which needs a single table, as the bench does)."""
    prefetch = kind == "emb-sharded" and options.get("prefetch", True)
    if prefetch and len(tables) != 1:
        raise ValueError(
            f"emb-sharded prefetches the next batch's ids for one table; this model has "
            f'{len(tables)}: pass --options \'{{"emb-sharded": {{"prefetch": false}}}}\''
        )
    peers = world_size - 1
    forward: list[Collective] = []
    backward: list[Collective] = []
    background: list[Collective] = []
    for table in tables:
        if kind == "emb-sharded":
            routing = [
                Collective(ALLTOALL, ID_BYTES * peers),
                Collective(ALLTOALL, round(table.per_peer * ID_BYTES * peers)),
            ]
            (background if prefetch else forward).extend(routing)
            rows = round((table.per_peer + 1) * table.row_bytes() * peers)
            forward.append(Collective(ALLTOALL, rows))
            grads = round(table.per_peer * table.row_bytes() * peers)
            backward.append(Collective(ALLTOALL, grads))
        elif kind == "emb-allgather":
            backward.append(Collective(ALLGATHER, ID_BYTES))
            entry = ID_BYTES + table.row_bytes()
            backward.append(Collective(ALLGATHER, round(table.largest * entry)))
        else:
            raise ValueError(f"{kind!r} is not an embedding method")
    return TableTraffic(tuple(forward), tuple(backward), tuple(background))

"""What the embedding methods send: the ids a batch looks up, measured, and the collectives
that carry them (the cost model of ``emb-sharded`` and ``emb-allgather``).

Their traffic depends on the data, not only on the model: a sharded table moves only the
rows a batch looks up. So the ids are measured, as every rank would look them up on its own
batches, with a hook on each ``nn.Embedding``. With ``u`` distinct ids on a rank, ``p`` of
them owned by one given other rank (row ``r`` lives on rank ``r % W``), ``D`` the row
width, fp32 rows and int64 ids, per table and step (``direct``: an all-to-all, one latency
and ``N - 1`` messages of the given size per rank; see :mod:`thinwire.plan.cost`)::

    emb-sharded    routing   counts: direct(8)      ids: direct(8 p)          (prefetched:
                                                                               off the path)
                   forward   rows:   direct(4 D (p + 1))   (one status row per peer)
                   backward  row gradients: direct(4 D p)  (ready when the table's is)
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

from thinwire.plan.cost import ALLGATHER, DIRECT, Collective

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
    ``nn.Embedding``, the ids each rank looks up at each step (no gradients, no training)."""
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
            for step_inputs in batches:
                if len(step_inputs) != world_size:
                    raise ValueError(
                        f"each step needs one batch per rank ({world_size}), got {len(step_inputs)}"
                    )
                for inputs in step_inputs:
                    for ids in seen.values():
                        ids.clear()
                    model(inputs)
                    for name, ids in seen.items():
                        counts[name].append(_count(torch.cat(ids), world_size, len(counts[name])))
    finally:
        for handle in handles:
            handle.remove()
    return [
        _summarise(f"{name}.weight" if name else "weight", tables[name], counts[name], world_size)
        for name in tables
    ]


def _count(ids: Tensor, world_size: int, position: int) -> tuple[int, int, float]:
    """(step's index in the list, distinct ids, mean distinct ids owned by each other rank)."""
    unique = torch.unique(ids)
    rank = position % world_size
    owners = torch.bincount(unique % world_size, minlength=world_size).tolist()
    others = [n for owner, n in enumerate(owners) if owner != rank]
    return position // world_size, int(unique.numel()), statistics.fmean(others) if others else 0.0


def _summarise(
    name: str, table: nn.Embedding, counts: list[tuple[int, int, float]], world_size: int
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
    kind: str, tables: Sequence[TableLookups], options: dict[str, Any]
) -> TableTraffic:
    """The collectives of ``kind`` (``"emb-sharded"`` or ``"emb-allgather"``) for
    ``tables`` (see the module docstring); ``options``: the method's (``prefetch``)."""
    forward: list[Collective] = []
    backward: list[Collective] = []
    background: list[Collective] = []
    for table in tables:
        if kind == "emb-sharded":
            routing = [
                Collective(DIRECT, ID_BYTES),
                Collective(DIRECT, round(table.per_peer * ID_BYTES)),
            ]
            (background if options.get("prefetch", True) else forward).extend(routing)
            forward.append(Collective(DIRECT, round((table.per_peer + 1) * table.row_bytes())))
            backward.append(Collective(DIRECT, round(table.per_peer * table.row_bytes())))
        elif kind == "emb-allgather":
            backward.append(Collective(ALLGATHER, ID_BYTES))
            entry = ID_BYTES + table.row_bytes()
            backward.append(Collective(ALLGATHER, round(table.largest * entry)))
        else:
            raise ValueError(f"{kind!r} is not an embedding method")
    return TableTraffic(tuple(forward), tuple(backward), tuple(background))

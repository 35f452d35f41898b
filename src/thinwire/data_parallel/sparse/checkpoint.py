"""Checkpoints of models with sharded tables that load on any number of ranks.

A sharded table's ``state_dict`` holds this rank's rows only, which fits a restart on the
same number of ranks. These functions write the whole table instead (and the optimizer's
per-row state, e.g. SGD's momentum or Adam's moments, as whole tables too), so that a
checkpoint saved on W ranks loads on W' ranks, or into the plain model::

    model_state = full_state_dict(model)                       # collective
    optimizer_state = full_optimizer_state_dict(optimizer, model)  # collective
    if rank == 0:
        torch.save({"model": model_state, "optimizer": optimizer_state}, path)
    ...                                                        # any number of ranks later
    saved = torch.load(path)
    model.load_state_dict(saved["model"])                      # each rank keeps its rows
    load_full_optimizer_state_dict(optimizer, model, saved["optimizer"])
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from thinwire.data_parallel.sparse.embedding import ShardedEmbedding


def full_state_dict(model: nn.Module) -> dict[str, Any]:
    """``model.state_dict()`` with each sharded table's ``weight`` whole (collective)."""
    state = model.state_dict()
    metadata = getattr(state, "_metadata", {})
    for name, table in _tables(model).items():
        state[f"{name}.weight" if name else "weight"] = table.full_weight()
        metadata.get(name, {}).pop("thinwire_shard", None)  # whole now, not one rank's
    return state


def full_optimizer_state_dict(optimizer: torch.optim.Optimizer, model: nn.Module) -> dict[str, Any]:
    """``optimizer.state_dict()`` with the per-row state of each sharded table whole
    (collective); other parameters' state as it is (the same on every rank)."""
    return _map_table_state(
        optimizer, model, optimizer.state_dict(), lambda t, s: t.gather_shards(s)
    )


def load_full_optimizer_state_dict(
    optimizer: torch.optim.Optimizer, model: nn.Module, state: dict[str, Any]
) -> None:
    """Load what :func:`full_optimizer_state_dict` saved (on any number of ranks) into
    ``optimizer``, each rank keeping its rows of the tables' state."""
    optimizer.load_state_dict(
        _map_table_state(optimizer, model, copy.copy(state), lambda t, s: t.own_rows(s))
    )


def _tables(model: nn.Module) -> dict[str, ShardedEmbedding]:
    return {n: m for n, m in model.named_modules() if isinstance(m, ShardedEmbedding)}


def _map_table_state(
    optimizer: torch.optim.Optimizer,
    model: nn.Module,
    state: dict[str, Any],
    convert: Callable[[ShardedEmbedding, Tensor], Tensor],
) -> dict[str, Any]:
    """``state`` with every tensor of a sharded table's parameter converted; the indices
    are those ``optimizer.state_dict()`` gives its parameters (in param_groups order)."""
    index = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            index.setdefault(id(param), len(index))
    per_param = dict(state["state"])
    for name, table in _tables(model).items():
        position = index.get(id(table.weight))
        if position is None or position not in per_param:
            continue  # not optimised here, or no state yet (before the first step)
        entry = dict(per_param[position])
        for key, value in entry.items():
            if not isinstance(value, Tensor) or value.dim() == 0:
                continue  # step counters and the like: the same on every rank
            if value.is_sparse:
                raise ValueError(
                    f"the optimizer keeps a sparse {key!r} for table {name!r}; only dense "
                    "per-row state can be resharded"
                )
            entry[key] = convert(table, value)
        per_param[position] = entry
    return {**state, "state": per_param}

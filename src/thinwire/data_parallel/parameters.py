"""Which parameters a data-parallel wrapper averages.

A model may tell DDP to leave some parameters alone (``_ddp_params_and_buffers_to_ignore``,
set through ``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model``):
:mod:`thinwire.data_parallel.sparse` does so for its tables, whose shards differ from rank
to rank by design and travel in their own exchange. thinwire's wrappers honour the same list, and
also skip any weight :mod:`thinwire.data_parallel.sparse` marked as a table (however the parameters
were handed over), so that they neither overwrite those shards with rank 0's nor average
them.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn


def ignored_names(model: nn.Module | Iterable[tuple[str, nn.Parameter]]) -> set[str]:
    """The parameter names ``model`` tells data-parallel wrappers to leave alone (none for
    an iterable of ``(name, parameter)`` pairs: the caller chose those itself)."""
    if not isinstance(model, nn.Module):
        return set()
    return set(getattr(model, "_ddp_params_and_buffers_to_ignore", ()))


#: the attribute thinwire.data_parallel.sparse sets on its tables' weights
TABLE_MARK = "_thinwire_sparse_table"


def is_table(param: nn.Parameter) -> bool:
    """Whether ``param`` is the weight of a :mod:`thinwire.data_parallel.sparse` table (found
    however the parameters were handed over: a module, a submodule, ``(name, parameter)``
    pairs)."""
    return bool(getattr(param, TABLE_MARK, False))


def split_parameters(
    model: nn.Module | Iterable[tuple[str, nn.Parameter]],
) -> tuple[list[tuple[str, nn.Parameter]], list[tuple[str, nn.Parameter]]]:
    """``model``'s ``(name, parameter)`` pairs to average (those that require gradients)
    and those left out for now (frozen), both less the ones ``model`` tells data-parallel
    wrappers to leave alone (:func:`ignored_names`) and
    :mod:`thinwire.data_parallel.sparse`'s tables."""
    ignored = ignored_names(model)
    named = model.named_parameters() if isinstance(model, nn.Module) else model
    given = [(name, p) for name, p in named if name not in ignored and not is_table(p)]
    return [(n, p) for n, p in given if p.requires_grad], [
        (n, p) for n, p in given if not p.requires_grad
    ]

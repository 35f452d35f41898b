"""Turning a model's ``nn.Embedding`` layers into sparse-communicating tables and back.

    shard_embeddings(model)      # each nn.Embedding -> ShardedEmbedding (rows over ranks)
    allgather_embeddings(model)  # each nn.Embedding -> AllGatherEmbedding (the baseline)
    ddp = DistributedDataParallel(model)   # DDP leaves the tables alone
    ...
    dense_embeddings(model)      # back to nn.Embedding with the whole table (collective)

Conversion keeps the table (rank 0's, broadcast) and registers the tables' parameters with
DDP's ignore list on ``model``, so that wrapping ``model`` afterwards all-reduces only the
dense parameters. What cannot be converted is refused with the module's name and a way out.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from thinwire.comm.collectives import run_collective
from thinwire.data_parallel.sparse.allgather import AllGatherEmbedding
from thinwire.data_parallel.sparse.embedding import ShardedEmbedding

SparseTable = ShardedEmbedding | AllGatherEmbedding


def shard_embeddings(
    model: nn.Module,
    *,
    group: dist.ProcessGroup | None = None,
    sparse_grad: bool = False,
    overlap: bool = True,
) -> list[str]:
    """Replace every ``nn.Embedding`` in ``model`` by a :class:`ShardedEmbedding` holding
    rank 0's table (collective); return the replaced modules' names.

    Refused, naming the module and what to do: an embedding whose weight is tied to another
    parameter (a tied output projection would need the whole table on every rank), and
    ``padding_idx``, ``max_norm``, ``scale_grad_by_freq`` or ``sparse=True`` (pass
    ``sparse_grad=True`` here instead). The new tables keep the old one's device, dtype and
    ``requires_grad``.
    """

    def build(module: nn.Embedding) -> ShardedEmbedding:
        return ShardedEmbedding(
            module.num_embeddings,
            module.embedding_dim,
            group=group,
            sparse_grad=sparse_grad,
            overlap=overlap,
        )

    return _replace(model, build, group)


def allgather_embeddings(
    model: nn.Module, *, group: dist.ProcessGroup | None = None, sparse_grad: bool = False
) -> list[str]:
    """Replace every ``nn.Embedding`` in ``model`` by an :class:`AllGatherEmbedding` (the
    sparse all-gather baseline) holding rank 0's table (collective); the same refusals as
    :func:`shard_embeddings`."""

    def build(module: nn.Embedding) -> AllGatherEmbedding:
        return AllGatherEmbedding(
            module.num_embeddings, module.embedding_dim, group=group, sparse_grad=sparse_grad
        )

    return _replace(model, build, group)


def dense_embeddings(model: nn.Module) -> list[str]:
    """Replace every sharded or all-gather table in ``model`` by an ``nn.Embedding`` holding
    the whole table (collective for sharded tables: every rank gathers every shard), e.g. to
    evaluate or save the model on one process; return the replaced modules' names."""
    replaced = []
    for name, module in list(model.named_modules()):
        if not isinstance(module, SparseTable):
            continue
        full = module.full_weight() if isinstance(module, ShardedEmbedding) else module.weight
        plain = nn.Embedding.from_pretrained(
            full.detach().clone(), freeze=not module.weight.requires_grad
        )
        module.close()
        _set_module(model, name, plain)
        replaced.append(name)
    ignored = set(getattr(model, "_ddp_params_and_buffers_to_ignore", ()))
    gone = {f"{name}.weight" for name in replaced}
    if ignored & gone:
        model._ddp_params_and_buffers_to_ignore = sorted(ignored - gone)
    return replaced


def sparse_table_parameters(model: nn.Module) -> list[str]:
    """Names of the parameters of ``model``'s sharded and all-gather tables: the ones a
    data-parallel wrapper must not all-reduce."""
    return [
        f"{name}.weight" if name else "weight"
        for name, module in model.named_modules()
        if isinstance(module, SparseTable)
    ]


def _replace(
    model: nn.Module,
    build: Callable[[nn.Embedding], SparseTable],
    group: dist.ProcessGroup | None,
) -> list[str]:
    if any(isinstance(module, DistributedDataParallel) for module in model.modules()):
        raise TypeError(
            "convert the embeddings before wrapping the model in DistributedDataParallel: "
            "DDP has already bucketed the tables' gradients and would wait for them forever. "
            "Call shard_embeddings(model) (or allgather_embeddings), then DDP(model)"
        )
    names_of: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(param), []).append(name)
    embeddings = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Embedding)]
    for name, module in embeddings:  # check them all before changing anything
        check_convertible(name, module, names_of.get(id(module.weight), []))
    replaced = []
    for name, module in embeddings:
        table = module.weight.detach().clone()
        root = dist.get_global_rank(group, 0) if group else 0
        run_collective(f"the broadcast of {name!r}", dist.broadcast, table, src=root, group=group)
        sparse = build(module).to(device=table.device, dtype=table.dtype)
        if isinstance(sparse, ShardedEmbedding):
            sparse.load_full_weight(table)
        else:
            sparse.weight.data.copy_(table)
        sparse.weight.requires_grad_(module.weight.requires_grad)
        _set_module(model, name, sparse)
        replaced.append(name)
    ignored = set(getattr(model, "_ddp_params_and_buffers_to_ignore", ()))
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
        model, sorted(ignored | set(sparse_table_parameters(model)))
    )
    return replaced


def check_convertible(name: str, module: nn.Embedding, shared: list[str]) -> None:
    """Refuse, saying what to do, an embedding that cannot be sharded: one tied to other
    weights (``shared`` names them) or built with options a shard cannot honour."""
    if len(shared) > 1:
        raise ValueError(
            f"embedding {name!r} shares its weight with {', '.join(shared[1:])} (a tied "
            "output projection?); a sparse table cannot also serve as a dense layer on "
            "every rank: untie them (give the output layer its own weight) or leave this "
            "embedding dense"
        )
    unsupported = [
        option
        for option, value in (
            ("padding_idx", module.padding_idx),
            ("max_norm", module.max_norm),
            ("scale_grad_by_freq", module.scale_grad_by_freq or None),
            ("sparse", module.sparse or None),
        )
        if value is not None
    ]
    if unsupported:
        raise ValueError(
            f"embedding {name!r} uses {', '.join(unsupported)}, which thinwire's sparse "
            "tables do not support; drop the option(s) (sparse gradients: pass "
            "sparse_grad=True to the conversion) or leave this embedding dense"
        )


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)

"""How each benchmark method wraps a model for data parallelism.

The methods themselves (``local``, ``dense``, ``ddp-fp16``, ``ddp-powersgd``, ``dga``,
``ps-sync``, ``ps-async``, ``emb-allgather``, ``emb-sharded`` and every thinwire
compressor), their defaults and the validation of their options are named once, in
:mod:`thinwire.plan.methods`, which the cost model shares. Here they become models: DDP
with PyTorch's own hooks, DDP with a thinwire compressor registered, thinwire's
delayed-averaging and parameter-server front ends, or a model whose embeddings were made
sparse (:func:`prepare`, before the optimizer is built) with DDP for the rest.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

import thinwire
from thinwire.compress.base import is_real
from thinwire.data_parallel.buckets import BucketSpec, ddp_bucket_options
from thinwire.data_parallel.sparse import (
    ShardedEmbedding,
    allgather_embeddings,
    dense_embeddings,
    shard_embeddings,
)
from thinwire.plan.methods import (
    EMBEDDING_KINDS,
    WRAPPER_KINDS,
    Kind,
    method_kind,
    method_options,
    split_communicator,
)


@dataclass(frozen=True)
class Method:
    """One method of a benchmark: its ``name`` and the options it runs with."""

    name: str
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def kind(self) -> Kind:
        """How the method exchanges gradients (see :mod:`thinwire.plan.methods`)."""
        return method_kind(self.name)

    @property
    def applies_momentum(self) -> bool:
        """Whether the method applies momentum itself (the optimizer must not)."""
        return self.compressor() is not None and self.compressor().applies_momentum

    def compressor(self) -> thinwire.Compressor | None:
        """The thinwire compressor the method sends through, if any."""
        if self.kind is Kind.THINWIRE:
            return thinwire.compressor(self.name, **split_communicator(self.options)[0])
        if self.kind in WRAPPER_KINDS or self.kind in EMBEDDING_KINDS:
            return thinwire.compressor(
                self.options["compressor"], **self.options["compressor_options"]
            )
        return None


@dataclass
class Wrapped:
    """A model made data parallel: the ``model`` to call, the ``optimizer`` front end to
    step (the plain optimizer under DDP), the thinwire ``engine`` if any, and ``finish``,
    which leaves every rank with the agreed weights (DGA's flush, the server's close: part
    of training, its traffic counted), ``export``, which makes the model evaluable on one
    rank after the measurements (sharded tables made whole), and ``lookahead``, if set,
    which takes the next step's input as soon as it is known (the sharded table's
    prefetch)."""

    model: nn.Module
    optimizer: Any
    engine: thinwire.GradientExchange | None = None
    finish: Callable[[], None] = lambda: None
    export: Callable[[], None] = lambda: None
    lookahead: Callable[[torch.Tensor], None] | None = None


def buffer_sync_options(broadcast_buffers: bool) -> dict[str, Any]:
    """DDP's keyword arguments for (not) broadcasting the buffers before every forward pass:
    none for DDP's default (broadcasting); else ``forward_sync_buffers=False`` where DDP
    has it (torch 2.13 renamed the option and warns about the old name) and
    ``broadcast_buffers=False`` before that."""
    if broadcast_buffers:
        return {}
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


def prepare(method: Method, model: nn.Module) -> nn.Module:
    """``model`` as ``method`` trains it, before its optimizer is built: the embedding
    methods replace its ``nn.Embedding`` layers (a collective); the others keep it."""
    kind = method.kind
    if kind not in EMBEDDING_KINDS:
        return model
    if kind is Kind.EMB_SHARDED:
        names = shard_embeddings(model, overlap=method.options["overlap"])
    else:
        names = allgather_embeddings(model)
    if not names:
        raise ValueError(
            f"method {method.name!r} needs a model with nn.Embedding layers, and this task's "
            "has none; choose a task with a large embedding (e.g. --task packages)"
        )
    return model


def parse_methods(
    names: str | list[str], options: dict[str, dict[str, Any]] | None = None, steps: int = 0
) -> list[Method]:
    """Methods from a comma-separated list, each with its defaults overridden by
    ``options[name]``; unknown names and options raise an error listing the choices.

    DGC warms up for a tenth of ``steps`` unless told otherwise, and PyTorch's PowerSGD
    hook runs at the rank of thinwire's ``powersgd`` when both are compared.
    """
    options = options or {}
    wanted = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
    wanted = [n for n in wanted if n]
    if not wanted:
        raise ValueError("no methods given; e.g. --methods local,dense,dgc,powersgd")
    unknown_options = sorted(set(options) - set(wanted))
    if unknown_options:
        raise ValueError(f"--options names methods not in --methods: {unknown_options}")
    given = {name: dict(options.get(name, {})) for name in wanted}
    if "dgc" in given:
        given["dgc"].setdefault("warmup_steps", steps // 10)
    merged = {name: method_options(name, given[name]) for name in wanted}
    hook = given.get("ddp-powersgd")
    if (
        hook is not None
        and "powersgd" in merged
        and not {"rank", "matrix_approximation_rank"} & set(hook)
    ):
        merged["ddp-powersgd"]["matrix_approximation_rank"] = merged["powersgd"]["rank"]
    return [Method(name, merged[name]) for name in wanted]


def wrap(
    method: Method,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    bucket_cap_mb: BucketSpec = None,
    fuse_rounds: bool = True,
    broadcast_buffers: bool = True,
) -> Wrapped:
    """``model`` made data parallel by ``method``.

    ``bucket_cap_mb``: DDP's bucket size (``None``: DDP's default, a 1 MB first bucket
    and 25 MB after it; ``"tapered"`` or ``"tapered:TAIL:FACTOR"``:
    :func:`thinwire.tapered_buckets`; a size is also
    the bucket size of ``dga``, which otherwise takes 25 MB). ``fuse_rounds``: the option of
    that name of the DDP hook (:func:`thinwire.register`) and of ``dga``.
    ``broadcast_buffers``: DDP's option (rank 0's buffers, e.g. batch-norm statistics,
    sent to all at every forward).
    Call on every rank after ``torch.distributed`` is initialised (except for ``local``).
    ``ps-*`` run colocated: every rank is a worker and ranks ``0 .. servers-1`` also serve
    a shard.
    """
    kind = method.kind
    if kind is Kind.LOCAL:
        return Wrapped(model, optimizer)
    if kind is Kind.DGA:
        options = method.options
        dga = thinwire.DelayedAveraging(
            optimizer,
            model,
            options["compressor"],
            delay=options["delay"],
            lanes=options["lanes"],
            bucket_cap_mb=bucket_cap_mb if is_real(bucket_cap_mb) else 25.0,
            fuse_rounds=fuse_rounds,
            **options["compressor_options"],
        )
        return Wrapped(model, dga, dga.engine, dga.flush)
    if kind in (Kind.PS_SYNC, Kind.PS_ASYNC):
        options = method.options
        ps = thinwire.ParameterServer(
            optimizer,
            model,
            options["compressor"],
            mode="sync" if kind is Kind.PS_SYNC else "async",
            servers=options["servers"],
            staleness=options.get("staleness", 0),
            **options["compressor_options"],
        )
        return Wrapped(model, ps, None, ps.close)
    ddp_options = buffer_sync_options(broadcast_buffers)
    if kind in EMBEDDING_KINDS:
        ddp_options.update(ddp_bucket_options(bucket_cap_mb, model))
        return _wrap_embedding_model(method, model, optimizer, ddp_options, fuse_rounds)
    if kind is Kind.DDP_POWERSGD:
        # powerSGD_hook issues its Q all-reduce from a future callback; with several
        # buckets on gloo the ranks then issue collectives in different orders (a gloo
        # size-mismatch crash at 10 Mbit/s). One bucket keeps every rank's order the same.
        model_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
        ddp = DistributedDataParallel(model, bucket_cap_mb=model_mb + 1, **ddp_options)
    else:
        ddp_options.update(ddp_bucket_options(bucket_cap_mb, model))
        ddp = DistributedDataParallel(model, **ddp_options)
    if kind is Kind.DDP:
        return Wrapped(ddp, optimizer)
    if kind is Kind.DDP_FP16:
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        return Wrapped(ddp, optimizer)
    if kind is Kind.DDP_POWERSGD:
        state = powerSGD_hook.PowerSGDState(process_group=None, **method.options)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        return Wrapped(ddp, optimizer)
    engine = thinwire.register(
        ddp, method.name, optimizer=optimizer, fuse_rounds=fuse_rounds, **method.options
    )
    return Wrapped(ddp, optimizer, engine)


def _wrap_embedding_model(
    method: Method,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    ddp_options: dict[str, Any],
    fuse_rounds: bool = True,
) -> Wrapped:
    """A model :func:`prepare` made sparse, under DDP (built with ``ddp_options``, which
    leaves the tables alone), with the dense part's compressor if one is named."""
    options = method.options
    tables = [m for m in model.modules() if isinstance(m, ShardedEmbedding)]
    lookahead = None
    if options.get("prefetch"):
        if len(tables) != 1:
            raise ValueError(
                f"{method.name}: prefetch hands the next input to the model's one sharded "
                f"table, and this model has {len(tables)}; run it with prefetch false"
            )
        lookahead = tables[0].prefetch
    ddp = DistributedDataParallel(model, **ddp_options)
    engine = None
    if options["compressor"] != "none":
        engine = thinwire.register(
            ddp,
            options["compressor"],
            optimizer=optimizer,
            fuse_rounds=fuse_rounds,
            **options["compressor_options"],
        )
    return Wrapped(
        ddp, optimizer, engine, export=lambda: dense_embeddings(model), lookahead=lookahead
    )

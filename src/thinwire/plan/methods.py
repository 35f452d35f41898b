"""Method names, in one place: what ``thinwire plan`` predicts and ``thinwire bench`` runs.

A *method* is one way of exchanging gradients in a data-parallel step:

=================  ==========================================================================
``local``          no exchange at all: one worker's compute only (the scaling limit)
``dense``          PyTorch DDP's own fp32 all-reduce, bucket by bucket
``ddp-fp16``       DDP with PyTorch's ``fp16_compress_hook`` (fp16 all-reduce)
``ddp-powersgd``   DDP with PyTorch's ``powerSGD_hook`` (options: ``PowerSGDState``'s)
``dga``            ``thinwire.DelayedAveraging`` (options: ``delay``, ``lanes``, ``compressor``)
``ps-sync``        ``thinwire.ParameterServer``, synchronous (``servers``, ``compressor``)
``ps-async``       ``thinwire.ParameterServer``, asynchronous (``servers``, ``staleness``, ...)
``emb-allgather``  embeddings replicated, their gradients all-gathered as (ids, rows); DDP
``emb-sharded``    embeddings sharded over the ranks (``data_parallel.sparse``); DDP for the rest
any compressor     DDP with ``thinwire.register(ddp_model, name, **options)``
=================  ==========================================================================

``dga``, ``ps-sync`` and ``ps-async`` take ``compressor`` (a thinwire compressor name, default
``none``) and ``compressor_options`` (a dict) for what they send. ``ps-async`` also takes
``momentum``: the servers' momentum in place of the run's (``None``: the run's). Stale
gradients act as momentum of their own (Mitliagkas et al. 2016, "Asynchrony begets
momentum"), so asynchronous training usually wants less explicit momentum.

``emb-allgather`` and ``emb-sharded`` need a task whose model has ``nn.Embedding`` layers
(``packages``); its other parameters go through DDP, with ``compressor`` (default ``none``:
DDP's own all-reduce) if given. ``emb-sharded`` also takes ``overlap`` (the tables' own
process groups) and ``prefetch`` (route the next batch's ids during this step; needs
``overlap`` and a model that looks its input up in one table). The cost model models them
from the ids the task's batches look up (:mod:`thinwire.plan.embedding`).

    method_kind("dgc")          # Kind.THINWIRE
    method_options("ddp-powersgd", {"matrix_approximation_rank": 2})
"""

from __future__ import annotations

import enum
import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


class Kind(enum.Enum):
    """How a method exchanges gradients."""

    LOCAL = "local"  #: no exchange (compute only)
    DDP = "ddp"  #: DDP's built-in fp32 all-reduce
    DDP_FP16 = "ddp-fp16"  #: DDP + torch's fp16_compress_hook
    DDP_POWERSGD = "ddp-powersgd"  #: DDP + torch's powerSGD_hook
    THINWIRE = "thinwire"  #: DDP + a thinwire compressor via thinwire.register
    DGA = "dga"  #: thinwire.DelayedAveraging
    PS_SYNC = "ps-sync"  #: thinwire.ParameterServer(mode="sync")
    PS_ASYNC = "ps-async"  #: thinwire.ParameterServer(mode="async")
    EMB_ALLGATHER = "emb-allgather"  #: thinwire.data_parallel.sparse.AllGatherEmbedding + DDP
    EMB_SHARDED = "emb-sharded"  #: thinwire.data_parallel.sparse.ShardedEmbedding + DDP


#: the kinds that send a thinwire compressor's payloads without DDP
WRAPPER_KINDS = (Kind.DGA, Kind.PS_SYNC, Kind.PS_ASYNC)

#: the kinds whose ranks do not wait for each other every step: their throughput is the
#: wall-clock time per step, not the median of the slowest rank's step
UNSYNCHRONISED_KINDS = (Kind.DGA, Kind.PS_ASYNC)

#: the kinds that move embedding tables sparsely (and the rest through DDP)
EMBEDDING_KINDS = (Kind.EMB_ALLGATHER, Kind.EMB_SHARDED)


@dataclass(frozen=True)
class BuiltinMethod:
    """A method that is not a thinwire compressor: its ``kind``, a one-line ``summary``
    and the ``defaults`` of its options."""

    name: str
    kind: Kind
    summary: str
    defaults: Mapping[str, Any] = field(default_factory=dict)


#: The methods that are not thinwire compressors. ``ddp-powersgd`` defaults to
#: ``start_powerSGD_iter=2`` (the smallest PyTorch allows with error feedback) so that a
#: short benchmark measures PowerSGD, not the dense warm-up; the plan models the steady state.
BUILTIN_METHODS: dict[str, BuiltinMethod] = {
    m.name: m
    for m in (
        BuiltinMethod("local", Kind.LOCAL, "no exchange: one worker's compute only"),
        BuiltinMethod("dense", Kind.DDP, "PyTorch DDP fp32 all-reduce"),
        BuiltinMethod("ddp-fp16", Kind.DDP_FP16, "PyTorch DDP + fp16_compress_hook"),
        BuiltinMethod(
            "ddp-powersgd",
            Kind.DDP_POWERSGD,
            "PyTorch DDP + powerSGD_hook",
            {"matrix_approximation_rank": 2, "start_powerSGD_iter": 2, "min_compression_rate": 2},
        ),
        BuiltinMethod(
            "dga",
            Kind.DGA,
            "delayed gradient averaging: local step now, correction D steps later",
            {"delay": 2, "lanes": 2, "compressor": "none", "compressor_options": {}},
        ),
        BuiltinMethod(
            "ps-sync",
            Kind.PS_SYNC,
            "synchronous parameter server (push gradients, pull parameters)",
            {"servers": 1, "compressor": "none", "compressor_options": {}},
        ),
        BuiltinMethod(
            "ps-async",
            Kind.PS_ASYNC,
            "asynchronous parameter server with a staleness bound",
            {
                "servers": 1,
                "staleness": 2,
                "momentum": None,
                "compressor": "none",
                "compressor_options": {},
            },
        ),
        BuiltinMethod(
            "emb-allgather",
            Kind.EMB_ALLGATHER,
            "embedding gradients all-gathered as (row ids, rows); DDP for the rest",
            {"compressor": "none", "compressor_options": {}},
        ),
        BuiltinMethod(
            "emb-sharded",
            Kind.EMB_SHARDED,
            "embedding rows sharded over the ranks, all-to-all lookups; DDP for the rest",
            {"overlap": True, "prefetch": True, "compressor": "none", "compressor_options": {}},
        ),
    )
}

#: options a thinwire compressor gets unless given, recorded with its results: PowerSGD and
#: its one-round form at rank 2, the rank ``ddp-powersgd`` defaults to, so that the
#: implementations compare; the compressors' own defaults where they depart from the
#: published method (1-bit's and TernGrad's ``per_row``, DGC's ``masking``), named so
#: that every record says which form ran
DEFAULT_OPTIONS: dict[str, dict[str, Any]] = {
    "powersgd": {"rank": 2},
    "powersgd-oneround": {"rank": 2},
    "onebit": {"per_row": True},
    "terngrad": {"per_row": True},
    "dgc": {"masking": False},
}

#: what ``thinwire plan`` predicts when no ``--methods`` are given
DEFAULT_PLAN_METHODS = (
    "local",
    "dense",
    "ddp-fp16",
    "ddp-powersgd",
    "fp16",
    "powersgd",
    "powersgd-oneround",
    "dgc",
    "onebit",
    "terngrad",
)


def method_names() -> list[str]:
    """Every method name: the built-in ones, then the registered thinwire compressors."""
    from thinwire.compress.registry import compressors

    return [*BUILTIN_METHODS, *(n for n in compressors() if n not in BUILTIN_METHODS)]


def method_kind(name: str) -> Kind:
    """The :class:`Kind` of method ``name``; unknown names raise ``ValueError`` listing all."""
    if name in BUILTIN_METHODS:
        return BUILTIN_METHODS[name].kind
    from thinwire.compress.registry import compressors

    if name in compressors():
        return Kind.THINWIRE
    raise ValueError(f"unknown method {name!r}; choose one of: {', '.join(method_names())}")


def method_options(name: str, options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The options of method ``name``: its defaults updated with ``options``, validated.

    Thinwire compressors are built once to check their options; ``ddp-powersgd`` accepts the
    arguments of PyTorch's ``PowerSGDState`` (except ``process_group``) and ``rank`` for
    ``matrix_approximation_rank``; ``local``, ``dense`` and ``ddp-fp16`` take none.
    """
    kind = method_kind(name)
    given = dict(options or {})
    if kind is Kind.THINWIRE:
        from thinwire.comm.collectives import COMMUNICATORS
        from thinwire.compress.base import Aggregation
        from thinwire.compress.registry import compressor

        merged = {**DEFAULT_OPTIONS.get(name, {}), **given}
        options_of_compressor, communicator = split_communicator(merged)
        built = compressor(name, **options_of_compressor)  # raises on unknown/invalid options
        choices = ("auto", *COMMUNICATORS)
        if communicator not in choices:
            raise ValueError(
                f"{name}: communicator must be one of {', '.join(choices)}, got {communicator!r}"
            )
        if communicator == "allreduce" and built.aggregation is Aggregation.GATHER:
            raise ValueError(
                f"{name}: its payloads must be gathered (they cannot be summed), so it cannot "
                "run on communicator 'allreduce'; use 'allgather', 'direct' or 'auto'"
            )
        return merged
    if kind is Kind.DDP_POWERSGD and "rank" in given:  # thinwire's spelling, as bench uses
        if "matrix_approximation_rank" in given:
            raise ValueError("give ddp-powersgd either rank or matrix_approximation_rank, not both")
        given["matrix_approximation_rank"] = given.pop("rank")
    merged = {**BUILTIN_METHODS[name].defaults, **given}
    if kind in WRAPPER_KINDS or kind in EMBEDDING_KINDS:
        _check_wrapper_options(name, merged, set(given) - set(BUILTIN_METHODS[name].defaults))
        own = DEFAULT_OPTIONS.get(merged["compressor"], {})
        return {**merged, "compressor_options": {**own, **merged["compressor_options"]}}
    accepted = _powersgd_options() if kind is Kind.DDP_POWERSGD else set()
    unknown = sorted(set(given) - accepted)
    if unknown:
        raise ValueError(
            f"method {name!r} has no option(s) {', '.join(unknown)}; "
            f"its options are: {', '.join(sorted(accepted)) or 'none'}"
        )
    if kind is Kind.DDP_POWERSGD:
        rank = merged["matrix_approximation_rank"]
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            spelled = "rank" if "rank" in (options or {}) else "matrix_approximation_rank"
            raise ValueError(f"ddp-powersgd: {spelled} must be an integer >= 1, got {rank!r}")
    return merged


def check_servers(name: str, options: Mapping[str, Any], workers: int) -> None:
    """Refuse more parameter-server shards than workers: ``thinwire bench`` and ``thinwire
    plan`` run the servers inside worker ranks (colocated), at most one per rank."""
    servers = options.get("servers", 0)
    if servers > workers:
        raise ValueError(
            f"{name}: {servers} server(s) for {workers} worker(s); the servers run inside "
            "worker ranks, so use at most one per worker"
        )


def split_communicator(options: Mapping[str, Any]) -> tuple[dict[str, Any], str]:
    """A thinwire method's options without ``communicator``, and the communicator
    (``"auto"`` unless given): the one option that configures the exchange, not the
    compressor."""
    rest = dict(options)
    return rest, rest.pop("communicator", "auto")


def _check_wrapper_options(name: str, merged: dict[str, Any], unknown: set[str]) -> None:
    """Validate the options of ``dga``, ``ps-sync`` and ``ps-async``."""
    if unknown:
        raise ValueError(
            f"method {name!r} has no option(s) {', '.join(sorted(unknown))}; its options are: "
            f"{', '.join(sorted(BUILTIN_METHODS[name].defaults))}"
        )
    for key in ("delay", "staleness"):
        if key in merged:
            value = merged[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}: {key} must be an integer >= 0, got {value!r}")
    for key in ("lanes", "servers"):
        if key in merged:
            value = merged[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: {key} must be an integer >= 1, got {value!r}")
    momentum = merged.get("momentum")
    if momentum is not None and not (
        isinstance(momentum, (int, float)) and not isinstance(momentum, bool) and 0 <= momentum < 1
    ):
        raise ValueError(f"{name}: momentum must be in [0, 1) or null, got {momentum!r}")
    if not isinstance(merged["compressor_options"], Mapping):
        raise ValueError(
            f"{name}: compressor_options must be a dict, got {merged['compressor_options']!r}"
        )
    for key in ("overlap", "prefetch"):
        if key in merged and not isinstance(merged[key], bool):
            raise ValueError(f"{name}: {key} must be true or false, got {merged[key]!r}")
    if merged.get("prefetch") and not merged.get("overlap", True):
        raise ValueError(f"{name}: prefetch needs overlap (the prefetch's own process group)")
    if merged.get("overlap") is False and merged["compressor"] != "none":
        raise ValueError(
            f"{name}: a thinwire compressor exchanges the dense gradients from its own thread "
            "on DDP's process group, so the table needs its own group: keep overlap true"
        )
    from thinwire.compress.feedback import NoMemory
    from thinwire.compress.registry import compressor

    built = compressor(merged["compressor"], **merged["compressor_options"])  # unknown name?
    if merged.get("lanes", 1) > 1 and not (
        built.stateless and isinstance(built.make_memory(), NoMemory)
    ):
        raise ValueError(
            f"{name}: lanes={merged['lanes']} runs several steps' exchanges at once, but "
            f"compressor {merged['compressor']!r} carries state from one step to the next, so "
            "its steps must run in order: use lanes 1, or a stateless compressor (none, fp16, "
            "bf16)"
        )
    if name.startswith("emb-") and built.applies_momentum:
        raise ValueError(
            f"{name}: compressor {merged['compressor']!r} applies momentum itself, which would "
            "take it from the tables' optimizer too; choose one that leaves momentum to the "
            "optimizer (e.g. powersgd, onebit, fp16)"
        )


def _powersgd_options() -> set[str]:
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

    params = inspect.signature(PowerSGDState.__init__).parameters
    return {p for p in params if p not in ("self", "process_group")}

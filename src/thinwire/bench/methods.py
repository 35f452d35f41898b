"""The benchmark's methods: a strategy name and the options it runs with.

What each name means (its options, how it wraps a model, how the planner costs it) is
decided in one place, the registry of :mod:`thinwire.strategies`; here a benchmark's
``--methods`` and ``--options`` become :class:`Method` values, and :func:`prepare` and
:func:`wrap` hand them to their strategy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

import thinwire
from thinwire.data_parallel.buckets import BucketSpec
from thinwire.strategies import Strategy, Wrapped, WrapSetup, strategy


@dataclass(frozen=True)
class Method:
    """One method of a benchmark: its ``name`` and the options it runs with."""

    name: str
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def strategy(self) -> Strategy:
        """The training strategy the name stands for."""
        return strategy(self.name)

    @property
    def applies_momentum(self) -> bool:
        """Whether the method applies momentum itself (the optimizer must not)."""
        built = self.compressor()
        return built is not None and built.applies_momentum

    def compressor(self) -> thinwire.Compressor | None:
        """The thinwire compressor the method sends through, if any."""
        return self.strategy.compressor(self.options)


def prepare(method: Method, model: nn.Module) -> nn.Module:
    """``model`` as ``method`` trains it, before its optimizer is built: the embedding
    methods replace its ``nn.Embedding`` layers (a collective); the others keep it."""
    return method.strategy.prepare(model, method.options)


def parse_methods(
    names: str | list[str], options: dict[str, dict[str, Any]] | None = None, steps: int = 0
) -> list[Method]:
    """Methods from a comma-separated list, each with its defaults overridden by
    ``options[name]``; unknown names and options raise an error listing the choices.

    DGC warms up for a tenth of ``steps`` unless told otherwise (also where ``dga``, a
    parameter server or an embedding method carries it), so that a benchmark measures its
    steady state; PyTorch's PowerSGD hook runs at the rank of thinwire's ``powersgd`` when
    both are compared.
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
    for chosen in given.values():
        if chosen.get("compressor") == "dgc":
            carried = dict(chosen.get("compressor_options") or {})
            carried.setdefault("warmup_steps", steps // 10)
            chosen["compressor_options"] = carried
    merged = {name: strategy(name).options(given[name]) for name in wanted}
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
    """``model`` made data parallel by ``method`` (see
    :class:`~thinwire.strategies.base.WrapSetup` for the other arguments). Call on every
    rank after ``torch.distributed`` is initialised (except for ``local``); ``ps-*`` run
    colocated: every rank is a worker and ranks ``0 .. servers-1`` also serve a shard."""
    setup = WrapSetup(bucket_cap_mb, fuse_rounds, broadcast_buffers)
    return method.strategy.wrap(model, optimizer, method.options, setup)

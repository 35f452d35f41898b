"""How each benchmark method wraps a model for data parallelism.

The methods themselves (``local``, ``dense``, ``ddp-fp16``, ``ddp-powersgd`` and every
thinwire compressor), their defaults and the validation of their options are named once,
in :mod:`thinwire.plan.methods`, which the cost model shares. Here they become models:
DDP with PyTorch's own hooks, or DDP with a thinwire compressor registered.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

import thinwire
from thinwire.plan.methods import Kind, method_kind, method_options


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
        return self.kind is Kind.THINWIRE and (
            thinwire.compressor(self.name, **self.options).applies_momentum
        )


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
    bucket_cap_mb: float | None = None,
) -> tuple[nn.Module, thinwire.GradientExchange | None]:
    """``model`` made data parallel by ``method``; the thinwire engine, if any.

    ``bucket_cap_mb``: DDP's bucket size (``None``: DDP's default, a 1 MB first bucket
    and 25 MB after it). Call on every rank after ``torch.distributed`` is initialised
    (except for ``local``).
    """
    kind = method.kind
    if kind is Kind.LOCAL:
        return model, None
    if kind is Kind.DDP_POWERSGD:
        # powerSGD_hook issues its Q all-reduce from a future callback; with several
        # buckets on gloo the ranks then issue collectives in different orders (a gloo
        # size-mismatch crash at 10 Mbit/s). One bucket keeps every rank's order the same.
        model_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
        ddp = DistributedDataParallel(model, bucket_cap_mb=model_mb + 1)
    elif bucket_cap_mb is not None:
        ddp = DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
    else:
        ddp = DistributedDataParallel(model)
    if kind is Kind.DDP:
        return ddp, None
    if kind is Kind.DDP_FP16:
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        return ddp, None
    if kind is Kind.DDP_POWERSGD:
        state = powerSGD_hook.PowerSGDState(process_group=None, **method.options)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        return ddp, None
    engine = thinwire.register(ddp, method.name, optimizer=optimizer, **method.options)
    return ddp, engine

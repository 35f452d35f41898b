"""The methods a benchmark compares, and how each one wraps a model for data parallelism.

    local          no gradient exchange at all: each process trains alone (compute-only limit)
    dense          PyTorch DDP's own fp32 all-reduce
    ddp-fp16       PyTorch's built-in ``fp16_compress_hook``
    ddp-powersgd   PyTorch's built-in ``powerSGD_hook`` (at the rank of thinwire's powersgd)
    <compressor>   a thinwire compressor through the DDP hook: dgc, powersgd, onebit, ...

Options for thinwire compressors come from ``--options``; a few defaults make the methods
comparable out of the box (DGC at density 0.001 after a warm-up of a tenth of the steps,
PowerSGD at rank 2, the same rank for both PowerSGD implementations).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

import thinwire

BASELINES = {
    "local": "no exchange: every process trains alone (the compute-only limit)",
    "dense": "PyTorch DDP's own fp32 all-reduce",
    "ddp-fp16": "PyTorch's fp16_compress_hook",
    "ddp-powersgd": "PyTorch's powerSGD_hook at the same rank as thinwire's powersgd",
}

#: options a method gets unless the user gives them (``warmup_steps`` is filled in per run)
DEFAULT_OPTIONS: dict[str, dict[str, Any]] = {
    "dgc": {"density": 0.001},
    "powersgd": {"rank": 2},
}

#: compressors that apply momentum themselves: their optimizer is plain SGD
OWN_MOMENTUM = frozenset({"dgc"})


@dataclass(frozen=True)
class Method:
    """One method of a benchmark: its ``name`` and the options it runs with."""

    name: str
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def is_thinwire(self) -> bool:
        """Whether the method is a thinwire compressor (not a PyTorch baseline)."""
        return self.name not in BASELINES

    @property
    def applies_momentum(self) -> bool:
        """Whether the method applies momentum itself (the optimizer must not)."""
        return self.name in OWN_MOMENTUM


def parse_methods(
    names: str | list[str], options: dict[str, dict[str, Any]] | None = None, steps: int = 0
) -> list[Method]:
    """Methods from a comma-separated list, each with its defaults overridden by
    ``options[name]``; unknown names and options raise an error listing the choices."""
    options = options or {}
    wanted = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
    wanted = [n for n in wanted if n]
    if not wanted:
        raise ValueError("no methods given; e.g. --methods local,dense,dgc,powersgd")
    unknown_options = sorted(set(options) - set(wanted))
    if unknown_options:
        raise ValueError(f"--options names methods not in --methods: {unknown_options}")
    known = {*BASELINES, *thinwire.compressors()}
    methods = []
    for name in wanted:
        if name not in known:
            raise ValueError(f"unknown method {name!r}; choose from: {', '.join(sorted(known))}")
        merged = {**DEFAULT_OPTIONS.get(name, {}), **options.get(name, {})}
        if name == "dgc":
            merged.setdefault("warmup_steps", steps // 10)
        if name in BASELINES and name != "ddp-powersgd" and merged:
            raise ValueError(f"method {name!r} takes no options, got {sorted(merged)}")
        if name not in BASELINES:
            thinwire.compressor(name, **merged)  # validates the options now, not on the ranks
        methods.append(Method(name, merged))
    powersgd_rank = next((m.options["rank"] for m in methods if m.name == "powersgd"), 2)
    return [
        Method(m.name, {"rank": powersgd_rank, **m.options}) if m.name == "ddp-powersgd" else m
        for m in methods
    ]


def wrap(
    method: Method, model: nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[nn.Module, thinwire.GradientExchange | None]:
    """``model`` made data parallel by ``method``; the thinwire engine, if any.

    Call on every rank after ``torch.distributed`` is initialised (except for ``local``).
    """
    if method.name == "local":
        return model, None
    ddp = DistributedDataParallel(model)
    if method.name == "dense":
        return ddp, None
    if method.name == "ddp-fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        return ddp, None
    if method.name == "ddp-powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=method.options["rank"],
            start_powerSGD_iter=2,  # its minimum with error feedback: dense for 2 steps
            min_compression_rate=2,
        )
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        return ddp, None
    engine = thinwire.register(ddp, method.name, optimizer=optimizer, **method.options)
    return ddp, engine

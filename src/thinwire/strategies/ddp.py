"""Strategies without thinwire's engine: no exchange at all, and PyTorch DDP with its own
all-reduce or one of PyTorch's communication hooks.

``ddp-powersgd`` defaults to ``start_powerSGD_iter=2`` (the smallest PyTorch allows with
error feedback) so that a short benchmark measures PowerSGD, not the dense warm-up; the
plan models the steady state.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from thinwire.strategies.base import Strategy, Wrapped, WrapSetup
from thinwire.strategies.registry import register_strategy


@register_strategy
class Local(Strategy):
    """No exchange at all: one worker's compute only (the scaling limit)."""

    name = "local"
    summary = "no exchange: one worker's compute only"
    costing = "none"

    def wrap(self, model, optimizer, options, setup):  # type: ignore[no-untyped-def]
        """The model and optimizer as they are."""
        return Wrapped(model, optimizer)


@register_strategy
class Dense(Strategy):
    """PyTorch DDP's own fp32 all-reduce, bucket by bucket."""

    name = "dense"
    summary = "PyTorch DDP fp32 all-reduce"
    costing = "dense"

    def wrap(self, model, optimizer, options, setup):  # type: ignore[no-untyped-def]
        """``model`` under DDP."""
        return Wrapped(setup.ddp(model), optimizer)


@register_strategy
class TorchFP16(Strategy):
    """DDP with PyTorch's ``fp16_compress_hook`` (fp16 all-reduce)."""

    name = "ddp-fp16"
    summary = "PyTorch DDP + fp16_compress_hook"
    costing = "torch-fp16"

    def wrap(self, model, optimizer, options, setup):  # type: ignore[no-untyped-def]
        """``model`` under DDP with the fp16 hook."""
        ddp = setup.ddp(model)
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        return Wrapped(ddp, optimizer)


@register_strategy
class TorchPowerSGD(Strategy):
    """DDP with PyTorch's ``powerSGD_hook``; options: ``PowerSGDState``'s (``rank`` is
    thinwire's spelling of ``matrix_approximation_rank``)."""

    name = "ddp-powersgd"
    summary = "PyTorch DDP + powerSGD_hook"
    costing = "torch-powersgd"
    defaults: ClassVar[Mapping[str, Any]] = {
        "matrix_approximation_rank": 2,
        "start_powerSGD_iter": 2,
        "min_compression_rate": 2,
    }

    def options(self, given: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """``PowerSGDState``'s arguments (except ``process_group``), validated."""
        given = dict(given or {})
        spelled = "rank" if "rank" in given else "matrix_approximation_rank"
        if "rank" in given:  # thinwire's spelling, as bench uses
            if "matrix_approximation_rank" in given:
                raise ValueError(
                    "give ddp-powersgd either rank or matrix_approximation_rank, not both"
                )
            given["matrix_approximation_rank"] = given.pop("rank")
        accepted = _powersgd_options()
        unknown = sorted(set(given) - accepted)
        if unknown:
            raise ValueError(
                f"method {self.name!r} has no option(s) {', '.join(unknown)}; "
                f"its options are: {', '.join(sorted(accepted))}"
            )
        merged = {**self.defaults, **given}
        rank = merged["matrix_approximation_rank"]
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"ddp-powersgd: {spelled} must be an integer >= 1, got {rank!r}")
        return merged

    def wrap(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        options: Mapping[str, Any],
        setup: WrapSetup,
    ) -> Wrapped:
        """``model`` under DDP in one bucket, with PyTorch's PowerSGD hook."""
        # powerSGD_hook issues its Q all-reduce from a future callback; with several
        # buckets on gloo the ranks then issue collectives in different orders (a gloo
        # size-mismatch crash at 10 Mbit/s). One bucket keeps every rank's order the same.
        model_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
        ddp = setup.ddp(model, bucket_cap_mb=model_mb + 1)
        state = powerSGD_hook.PowerSGDState(process_group=None, **options)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        return Wrapped(ddp, optimizer)


def _powersgd_options() -> set[str]:
    params = inspect.signature(powerSGD_hook.PowerSGDState.__init__).parameters
    return {p for p in params if p not in ("self", "process_group")}

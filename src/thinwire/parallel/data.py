"""Data parallelism over the mesh's ``"dp"`` groups, through thinwire's engine.

Each pipeline stage and tensor shard has ``dp`` copies, one per data-parallel rank; they
average their gradients over their ``"dp"`` group only (a tensor-parallel shard's
gradient is its local part, the same part on every peer), with the plan's method: dense
(an all-reduce of each bucket) or a thinwire compressor, error feedback included. That is
where compression pays on a cheap network: the ``"dp"`` groups are the ones that span hosts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from thinwire.data_parallel.local_methods import ROUND_METHODS, build_rounds
from thinwire.data_parallel.local_steps import DiLoCo
from thinwire.data_parallel.optimizer import DistributedOptimizer
from thinwire.parallel.plan import ParallelPlan, engine_compressor

OptimizerSpec = torch.optim.Optimizer | Callable[[list[nn.Parameter]], torch.optim.Optimizer]


def build_optimizer(
    spec: OptimizerSpec | None, parameters: list[nn.Parameter]
) -> torch.optim.Optimizer:
    """The optimizer over this rank's (sharded) parameters: ``spec(parameters)`` for a
    factory, or one of the same class and settings for an optimizer built over the whole
    model (whose parameters this rank no longer holds)."""
    if spec is None:
        raise ValueError(
            "parallelize needs an optimizer: pass optimizer=lambda params: "
            "torch.optim.AdamW(params, lr=...) (or an optimizer built over the model)"
        )
    if isinstance(spec, torch.optim.Optimizer):
        if len(spec.param_groups) != 1:
            raise ValueError(
                f"the optimizer has {len(spec.param_groups)} parameter groups; thinwire "
                "rebuilds it over each rank's shards and cannot tell which shard belongs to "
                "which group. Pass a factory instead: optimizer=lambda params: ..."
            )
        return type(spec)(parameters, **spec.defaults)
    if not callable(spec):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer or a function of the parameters, "
            f"got {type(spec).__name__}"
        )
    built = spec(parameters)
    if not isinstance(built, torch.optim.Optimizer):
        raise TypeError(
            f"the optimizer factory returned {type(built).__name__}, not a torch.optim.Optimizer"
        )
    return built


def apply_data_parallel(
    named_parameters: Iterable[tuple[str, nn.Parameter]],
    optimizer: torch.optim.Optimizer,
    mesh: DeviceMesh,
    plan: ParallelPlan,
    **engine_options: Any,
) -> torch.optim.Optimizer | DistributedOptimizer | DiLoCo:
    """The optimizer to step: ``optimizer`` itself when ``dp == 1``, else a
    :class:`~thinwire.DistributedOptimizer` averaging the gradients over ``mesh`` (the
    ``"dp"`` dimension) with ``plan.dp_method``, or for ``"diloco"`` and ``"local-sgd"``
    a :class:`~thinwire.DiLoCo` with ``optimizer`` as its inner optimizer. The copies
    start equal (every rank builds the model from the same seed;
    :func:`thinwire.parallelize` checks), so nothing is broadcast."""
    if plan.dp == 1:
        return optimizer
    if plan.dp_method in ROUND_METHODS:
        return build_rounds(
            plan.dp_method,
            optimizer,
            list(named_parameters),
            plan.dp_options,
            group=mesh.get_group(),
            broadcast_parameters=False,
            **engine_options,
        )
    return DistributedOptimizer(
        optimizer,
        list(named_parameters),
        engine_compressor(plan.dp_method),
        group=mesh.get_group(),
        broadcast_parameters=False,
        **engine_options,
        **plan.dp_options,
    )

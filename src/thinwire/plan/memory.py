"""Memory per rank of a data-parallel step: parameters, gradients, optimizer state and the
exchange's own state, each measured on the real objects, not assumed.

Optimizer state is measured by stepping the optimizer once on a small parameter (its bytes
per parameter byte, times the model's); the exchange's state by running the strategy's
exchange (thinwire's engine with its memory and compressor, or PyTorch's PowerSGD state)
for two steps on the model's shapes in this process and counting every tensor it holds:
error-feedback residuals (kept twice, so that a refused step can be undone), DGC's
velocities, PowerSGD's warm starts, scratch buffers.

    estimate = data_parallel_memory(model.named_parameters(), method="dgc", world_size=4,
                                    optimizer=torch.optim.SGD)
    estimate.total_bytes, estimate.as_dict()
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from thinwire.plan.profile_buckets import BUCKET_CAP_MB, bucket_groups
from thinwire.plan.profile_exchangers import Bucket, ThinwireEngine, build_exchanger
from thinwire.strategies import strategy


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank holds, by what holds them."""

    parameters: int
    gradients: int
    optimizer: int
    exchange: int
    activations: int = 0

    @property
    def total_bytes(self) -> int:
        """Everything together."""
        return self.parameters + self.gradients + self.optimizer + self.exchange + self.activations

    def as_dict(self) -> dict[str, int]:
        """A flat dict for reports and JSON."""
        return {**dataclasses.asdict(self), "total": self.total_bytes}


def held_bytes(*objects: Any, exclude: Iterable[Any] = ()) -> int:
    """The bytes of every distinct tensor reachable from ``objects`` through attributes,
    dicts, lists, tuples and sets (each storage counted once), less those reachable from
    ``exclude``."""
    skipped = _storages(list(exclude))
    return sum(n for ptr, n in _storages(list(objects)).items() if ptr not in skipped)


def _storages(stack: list[Any]) -> dict[int, int]:
    """Every tensor storage reachable from ``stack``: its address and its bytes."""
    seen: set[int] = set()
    found: dict[int, int] = {}
    while stack:
        item = stack.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, Tensor):
            storage = item.untyped_storage()
            found[storage.data_ptr()] = storage.nbytes()
        elif isinstance(item, Mapping):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple, set, frozenset)):
            stack.extend(item)
        elif not isinstance(item, type):
            stack.extend(getattr(item, "__dict__", {}).values())
            for cls in type(item).__mro__:  # objects with __slots__ (PowerSGDState)
                slots = cls.__dict__.get("__slots__", ())
                slots = (slots,) if isinstance(slots, str) else slots
                stack.extend(getattr(item, s) for s in slots if hasattr(item, s))
    return found


def optimizer_state_ratio(optimizer: type[torch.optim.Optimizer], **options: Any) -> float:
    """Bytes of ``optimizer``'s state per byte of parameters, after one step (SGD with
    momentum: 1, Adam: 2, plain SGD: 0; small per-parameter scalars such as Adam's step
    counter are what makes it a little more)."""
    param = torch.nn.Parameter(torch.zeros(4096))
    param.grad = torch.ones_like(param)
    stepped = optimizer([param], **options)
    stepped.step()
    return held_bytes(stepped.state, exclude=[param]) / (param.numel() * param.element_size())


def exchange_state_bytes(
    method: str,
    params: Iterable[tuple[str, Tensor]],
    *,
    world_size: int,
    options: Mapping[str, Any] | None = None,
) -> int:
    """Bytes the exchange of ``method`` (a strategy name) holds on one rank after its first
    compressed step on ``params``' shapes: thinwire's memory and compressor, or PyTorch's
    PowerSGD state. DDP's own buffers are not counted (they are the gradients' size,
    counted as gradients)."""
    chosen = strategy(method)
    opts = chosen.options(options)
    params = [(n, p.detach()) for n, p in params]
    if chosen.costing in ("none", "dense", "torch-fp16"):
        return 0
    if chosen.costing in ("wrapper", "embedding"):
        built = chosen.compressor(opts)
        if built is None or built.name == "none":
            return 0
        exchanger: Any = ThinwireEngine(built, world_size, fuse_rounds=False)
    else:
        exchanger = build_exchanger(chosen.costing, method, opts, world_size, fuse_rounds=True)
    groups = bucket_groups(params, None, BUCKET_CAP_MB)
    by_name = dict(params)
    buckets = [Bucket(i, [(n, by_name[n]) for n in names]) for i, names in enumerate(groups)]
    generator = torch.Generator().manual_seed(0)
    for run in range(getattr(exchanger, "warmup_runs", 1) + 1):  # past a dense start
        for bucket in buckets:
            bucket.fill(generator)
            exchanger(bucket, run, bucket is buckets[-1])
    held = exchanger.engine if isinstance(exchanger, ThinwireEngine) else exchanger
    return held_bytes(held, exclude=[buckets])  # the gradients are the profiler's, not its


def data_parallel_memory(
    params: Iterable[tuple[str, Tensor]],
    *,
    world_size: int,
    method: str = "dense",
    options: Mapping[str, Any] | None = None,
    optimizer: type[torch.optim.Optimizer] = torch.optim.SGD,
    optimizer_options: Mapping[str, Any] | None = None,
    activations: int = 0,
) -> MemoryEstimate:
    """What one rank of a data-parallel job holds: every parameter, its gradient, the
    optimizer's state (``optimizer`` with ``optimizer_options``), the exchange's state
    under ``method``, and ``activations`` (saved for the backward pass, measured by the
    caller)."""
    params = list(params)
    weights = sum(p.numel() * p.element_size() for _, p in params)
    ratio = optimizer_state_ratio(optimizer, **dict(optimizer_options or {"lr": 0.1}))
    return MemoryEstimate(
        parameters=weights,
        gradients=sum(p.numel() * 4 for _, p in params if p.requires_grad),
        optimizer=round(ratio * weights),
        exchange=exchange_state_bytes(method, params, world_size=world_size, options=options),
        activations=activations,
    )

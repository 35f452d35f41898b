"""The layer profiler: how long each part of a model takes, forward and backward.

A *stage* is a module that owns parameters, with the parameter-free work after it.
:func:`profile_stages` times every stage of a model on one batch, in the order the forward
pass calls them; ``thinwire bench --compute sleep`` replays those times as sleeps
(:mod:`thinwire.bench.sleeping`), and the planner will weigh pipeline stages and tensor
shards with them.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn


@dataclass(frozen=True)
class Stage:
    """One module that owns parameters: its ``name`` in the model and the seconds its
    forward (``forward_s``) and backward (``backward_s``) parts took, each including the
    parameter-free work up to the next stage."""

    name: str
    forward_s: float
    backward_s: float


def stage_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The modules that own parameters directly, by name, each parameter counted once
    (the first module that holds a shared one owns it)."""
    seen: set[int] = set()
    owners: dict[str, nn.Module] = {}
    for name, module in model.named_modules():
        own = [p for p in module.parameters(recurse=False) if id(p) not in seen]
        if own:
            seen.update(id(p) for p in own)
            owners[name] = module
    return owners


def own_parameters(module: nn.Module, owned: set[int]) -> list[nn.Parameter]:
    """``module``'s direct parameters that are not in ``owned`` (ids), which they join."""
    fresh = [p for p in module.parameters(recurse=False) if id(p) not in owned]
    owned.update(id(p) for p in fresh)
    return fresh


def profile_stages(
    model: nn.Module,
    batch: tuple[Tensor, Tensor],
    loss_fn: Callable[[Any, Tensor], Tensor],
    steps: int = 3,
) -> list[Stage]:
    """Time each stage of ``model`` on ``batch``, in the order the forward pass calls them:
    the median over ``steps`` steps after one to warm up. Forward: from one stage's end to
    the next one's (the first from the step's start, the last to the loss). Backward: from
    one stage's last gradient to the next one's, in the backward pass's order (the rest of
    the backward pass goes to the stage whose gradients came last)."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps!r}")
    owners = stage_modules(model)
    names = {id(module): name for name, module in owners.items()}
    order: list[str] = []
    forward_end: dict[str, float] = {}
    grad_ready: dict[str, float] = {}
    owned: set[int] = set()
    handles = []

    def after_forward(module: nn.Module, inputs: Any, output: Any) -> None:
        name = names[id(module)]
        if name not in forward_end:  # a module called twice ends at its first call
            forward_end[name] = time.perf_counter()
            order.append(name)

    for name, module in owners.items():
        handles.append(module.register_forward_hook(after_forward))
        for param in own_parameters(module, owned):
            handles.append(
                param.register_post_accumulate_grad_hook(
                    lambda _p, name=name: grad_ready.__setitem__(name, time.perf_counter())
                )
            )
    samples: list[tuple[list[str], dict[str, float], dict[str, float]]] = []
    x, y = batch
    try:
        for _ in range(steps + 1):
            order.clear()
            forward_end.clear()
            grad_ready.clear()
            model.zero_grad(set_to_none=True)
            began = time.perf_counter()
            loss = loss_fn(model(x), y)
            loss_at = time.perf_counter()
            loss.backward()
            ended = time.perf_counter()
            forward_s = _gaps([forward_end[n] for n in order], began, loss_at)
            backward_order = sorted(grad_ready, key=grad_ready.__getitem__)
            backward_s = _gaps([grad_ready[n] for n in backward_order], loss_at, ended)
            forward_by = dict(zip(order, forward_s, strict=True))
            backward_by = dict(zip(backward_order, backward_s, strict=True))
            samples.append((list(order), forward_by, backward_by))
    finally:
        for handle in handles:
            handle.remove()
    model.zero_grad(set_to_none=True)
    measured = samples[1:]
    first_order = measured[0][0]
    missing = set(owners) - set(first_order)
    if missing:
        raise ValueError(
            f"modules {sorted(missing)} own parameters but the forward pass never called them; "
            "--compute sleep needs every parameter used at every step"
        )
    return [
        Stage(
            name,
            statistics.median(s[1][name] for s in measured),
            statistics.median(s[2].get(name, 0.0) for s in measured),
        )
        for name in first_order
    ]


def _gaps(marks: list[float], start: float, end: float) -> list[float]:
    """Time from ``start`` to the first mark, between marks, and from the last to ``end``
    (added to the last gap)."""
    gaps = [b - a for a, b in zip([start, *marks[:-1]], marks, strict=True)]
    if gaps:
        gaps[-1] += max(0.0, end - marks[-1])
    return gaps

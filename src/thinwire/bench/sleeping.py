"""Compute that waits instead of working: an accelerator's step, emulated with sleeps.

On a GPU host the training math runs on the accelerator and leaves the CPU to the network:
DDP's hooks, the compressors' bookkeeping and the sockets. On this test bed the math runs on
the same few cores as all of that, so every collective also waits for a busy core. With
``thinwire bench --compute sleep`` the model keeps its parameters, and so its buckets,
hooks and gradients, but its forward and backward passes become sleeps of the times the
real model took on this machine, stage by stage (a stage is a module that owns parameters,
with the parameter-free work after it), and each stage's backward hands DDP the gradients
the real model produced on the first batch. The CPU is then free while the "accelerator"
works, as on a GPU host, and the ratio of compute to link time stays what it was.

Timings only: the weights take the same gradients at every step, so losses say nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from thinwire.plan.profile_layers import Stage, own_parameters, profile_stages, stage_modules

__all__ = [
    "COMPUTE_CHOICES",
    "SleepingModel",
    "Stage",
    "check_compute",
    "profile_stages",
    "sleeping_twin",
    "stage_modules",
]

#: ``real``: train the task's model; ``sleep``: an accelerator's compute, emulated by
#: sleeping each stage's measured time (timings only)
COMPUTE_CHOICES = ("real", "sleep")


def check_compute(compute: str, speedup: float, embedding_methods: list[str]) -> None:
    """Refuse a compute mode that is not one, a speed-up that is not a number > 0 or that
    has no sleeps to shorten, and ``--compute sleep`` for methods that replace embeddings
    (``embedding_methods``)."""
    if compute not in COMPUTE_CHOICES:
        raise ValueError(f"compute must be one of {COMPUTE_CHOICES}, got {compute!r}")
    if isinstance(speedup, bool) or not isinstance(speedup, int | float) or not 0 < speedup < 1e6:
        raise ValueError(f"--compute-speedup must be a number > 0, got {speedup!r}")
    if speedup != 1 and compute != "sleep":
        raise ValueError(
            f"--compute-speedup {speedup:g} shortens the sleeps of --compute sleep; real compute "
            "runs at this CPU's speed: add --compute sleep or drop the speed-up"
        )
    if compute == "sleep" and embedding_methods:
        raise ValueError(
            f"--compute sleep keeps the model's parameters as they are, and {embedding_methods} "
            "replace its embeddings; run those with --compute real"
        )


class _SleepThrough(torch.autograd.Function):
    """Identity on ``carrier`` that sleeps ``forward_s``, and on the way back sleeps
    ``backward_s`` and returns fresh copies of ``grads`` for ``params``."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        carrier: Tensor,
        forward_s: float,
        backward_s: float,
        grads: tuple[Tensor, ...],
        *params: Tensor,
    ) -> Tensor:
        ctx.backward_s, ctx.grads = backward_s, grads
        time.sleep(forward_s)
        return carrier.clone()

    @staticmethod
    def backward(ctx: Any, carried: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        time.sleep(ctx.backward_s)
        # copies: DDP writes the averaged gradient back into the tensor autograd gave it
        return (carried, None, None, None, *(g.clone() for g in ctx.grads))


class SleepingModel(nn.Module):
    """``model``'s parameters with a forward and backward pass that only sleep.

    Args:
        model: the real model (kept as a submodule, so DDP sees the same parameters).
        stages: its stages and their times (:func:`profile_stages`).
        output: a tensor of the shape and dtype the real forward pass returns (zeros are
            returned, carrying the gradient through the stages).
        grads: the gradient of each parameter (by ``id``) that its stage hands back.
    """

    def __init__(
        self,
        model: nn.Module,
        stages: list[Stage],
        output: Tensor,
        grads: dict[int, Tensor],
    ) -> None:
        super().__init__()
        self.model = model
        self.stages = stages
        self.output_shape = tuple(output.shape)
        self.output_dtype = output.dtype
        owners = stage_modules(model)
        owned: set[int] = set()
        self._params = [own_parameters(owners[stage.name], owned) for stage in stages]
        self._grads = [tuple(grads[id(p)] for p in params) for params in self._params]

    def forward(self, x: Tensor) -> Tensor:
        """Zeros of the real output's shape, after sleeping through every stage."""
        carrier = torch.zeros(self.output_shape, dtype=self.output_dtype, device=x.device)
        for stage, params, grads in zip(self.stages, self._params, self._grads, strict=True):
            carrier = _SleepThrough.apply(
                carrier, stage.forward_s, stage.backward_s, grads, *params
            )
        return carrier


def sleeping_twin(
    model: nn.Module,
    stages: list[Stage],
    batch: tuple[Tensor, Tensor],
    loss_fn: Callable[[Any, Tensor], Tensor],
) -> SleepingModel:
    """``model`` with its compute replaced by sleeps of ``stages``' times; the gradients it
    hands back are those of one real step on ``batch`` (the weights are left as they were)."""
    x, y = batch
    model.zero_grad(set_to_none=True)
    output = model(x)
    loss_fn(output, y).backward()
    grads = {id(p): p.grad.detach().clone() for p in model.parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    missing = [n for n, p in model.named_parameters() if id(p) not in grads]
    if missing:
        raise ValueError(
            f"parameters {missing} got no gradient on the first batch; --compute sleep needs "
            "every parameter used at every step"
        )
    return SleepingModel(model, stages, output.detach(), grads)

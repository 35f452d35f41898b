"""Recomputation per pipeline stage (activation checkpointing, Merak's stage-aware kind).

A stage with ratio ``r`` keeps the activations of its first ``1 - r`` of blocks and runs the
rest as one checkpointed segment: forward without saving anything but the segment's input
(and the random generator's state), and the segment's forward again before its backward.

    ratios = stage_aware_ratios(0.75, stages=4)      # (0.75, 0.625, 0.25, 0.0)
    plan = thinwire.ParallelPlan(pp=4, microbatches=8, recompute=ratios)

Under 1F1B, stage ``s`` of ``S`` (from 0) holds up to ``S - s`` micro-batches in flight, so
the later stages have memory to spare: Merak's rule (Lai et al., TPDS 2023) recomputes
``r_s = 1 - (1 - r_0)(S - 1)/(S - s)`` on stage ``s`` counted from 1, clamped to ``[0, 1]``,
and nothing on the last stage.

The recomputation is an action of its own: :meth:`Recomputation.recompute_next` rebuilds the
oldest pending micro-batch's graph at any time before its backward (a schedule runs it
while it waits for the incoming gradient); a backward that finds its graph not rebuilt
rebuilds it first. Either way the forward runs from the same input with the random
generator as it was (dropout draws the same masks), and the generator the rest of the step
sees is left as it would be without recomputation (the CPU's, and the CUDA device's the
input lives on), and so is ``torch.autocast``'s state of the forward.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor


def _check_ratio(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
        raise ValueError(
            f"{what} must be a fraction of a stage's blocks between 0 and 1, got {value!r}"
        )
    return float(value)


def stage_aware_ratios(first: float, stages: int) -> tuple[float, ...]:
    """Merak's per-stage recomputation ratios from the first stage's ``first``: stage ``s``
    (from 1) recomputes ``1 - (1 - first)(stages - 1)/(stages - s)``, clamped at 0; the
    last stage recomputes nothing."""
    first = _check_ratio(first, "the first stage's recomputation ratio")
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        raise ValueError(f"stages must be an integer >= 1, got {stages!r}")
    ratios = [max(0.0, 1 - (1 - first) * (stages - 1) / (stages - s)) for s in range(1, stages)]
    return (*ratios, 0.0) if stages > 1 else (first,)


def check_ratios(ratios: Sequence[float], stages: int) -> tuple[float, ...]:
    """``ratios`` as a tuple of one fraction per stage, or an error saying what is wrong."""
    ratios = tuple(ratios)
    if len(ratios) != stages:
        raise ValueError(
            f"recompute gives a ratio per pipeline stage: {stages} of them, got {len(ratios)} "
            f"({list(ratios)}); give one number for every stage, or a list of {stages}"
        )
    return tuple(_check_ratio(r, "a recomputation ratio") for r in ratios)


def checkpointed_blocks(ratio: float, blocks: int) -> int:
    """How many of a stage's ``blocks`` (its last ones) ratio ``ratio`` recomputes:
    ``ratio * blocks`` rounded half up."""
    return min(blocks, int(ratio * blocks + 0.5))


@dataclass(eq=False)
class _Pending:
    """One micro-batch's checkpointed segment, from its forward to its backward."""

    owner: Recomputation
    run: Callable[[Tensor], Tensor]
    parameters: tuple[Tensor, ...]
    rng_state: Tensor
    node: Callable[[], Any] = lambda: None
    """The segment's autograd node, weakly (it holds the input; gone with the graph)."""
    rebuilt: tuple[Tensor, Tensor] | None = field(default=None, repr=False)
    device: torch.device | None = None
    """The CUDA device whose generator the segment draws from, if any."""
    device_rng_state: Tensor | None = None
    autocast: tuple[tuple[str, bool, torch.dtype], ...] = ()
    """The autocast state of the forward, per device type, replayed by the recomputation."""


#: device types whose autocast state a recomputation replays
_AUTOCAST_DEVICES = ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)


class Recomputation:
    """The checkpointed segments of one stage's micro-batches, oldest first (``parts``
    of them per micro-batch when it runs in sub-batches)."""

    def __init__(self, parts: int = 1) -> None:
        self.parts = parts
        self.pending: deque[_Pending] = deque()
        self.recomputed = 0
        """Segments rebuilt so far (by :meth:`recompute_next` or by a backward)."""

    def run(
        self, segment: Callable[[Tensor], Tensor], x: Tensor, parameters: Sequence[Tensor]
    ) -> Tensor:
        """``segment(x)`` with nothing saved but ``x`` (``parameters``: those ``segment``
        uses); under ``torch.no_grad`` (evaluation) simply ``segment(x)``."""
        if not torch.is_grad_enabled() or x.device.type == "meta":
            return segment(x)
        trained = tuple(p for p in parameters if p.requires_grad)
        pending = _Pending(self, segment, trained, torch.get_rng_state())
        pending.autocast = tuple(
            (kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))
            for kind in _AUTOCAST_DEVICES
        )
        if x.is_cuda:  # dropout on the GPU draws from the device's generator
            pending.device, pending.device_rng_state = x.device, torch.cuda.get_rng_state(x.device)
        y = _Checkpointed.apply(x, pending, *trained)
        if y.grad_fn is not None:
            pending.node = weakref.ref(y.grad_fn)
            self.pending.append(pending)
        return y

    def _live(self) -> list[_Pending]:
        """The pending segments whose graph is still alive (a forward whose output was
        dropped, like a schedule's shape inference, leaves none)."""
        while self.pending and self.pending[0].node() is None:
            self.pending.popleft()
        return [p for p in self.pending if p.node() is not None]

    def recompute_next(self) -> bool:
        """Rebuild the oldest micro-batch's segment whose graph is not rebuilt yet (its
        sub-batches' in turns); ``False`` if none is pending."""
        waiting = [p for p in self._live() if p.rebuilt is None][: self.parts]
        if len(waiting) > 1:
            from thinwire.parallel.subpipeline import in_turns

            in_turns([lambda p=p: self._rebuild(p) for p in waiting])
        elif waiting:
            self._rebuild(waiting[0])
        return bool(waiting)

    def _rebuild(self, pending: _Pending) -> None:
        (x,) = pending.node().saved_tensors
        x = x.detach().requires_grad_(x.requires_grad)
        devices = [pending.device] if pending.device is not None else []
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.random.fork_rng(devices=devices))
            stack.enter_context(torch.enable_grad())
            for kind, enabled, dtype in pending.autocast:
                stack.enter_context(torch.autocast(kind, dtype=dtype, enabled=enabled))
            torch.set_rng_state(pending.rng_state)
            if pending.device is not None:
                torch.cuda.set_rng_state(pending.device_rng_state, pending.device)
            y = pending.run(x)
        pending.rebuilt = (x, y)
        self.recomputed += 1

    def backward(self, pending: _Pending, grad: Tensor) -> tuple[Tensor | None, ...]:
        """The segment's backward: its graph (rebuilt now if it was not), then the
        gradients of its input and its parameters for ``grad`` (none accumulated here: the
        caller's backward does, or not, as it would without recomputation)."""
        if pending.rebuilt is None:
            self._rebuild(pending)
        x, y = pending.rebuilt  # type: ignore[misc]
        pending.rebuilt = None
        if pending in self.pending:
            self.pending.remove(pending)
        wanted = ([x] if x.requires_grad else []) + list(pending.parameters)
        grads = torch.autograd.grad(y, wanted, grad, allow_unused=True)
        return (None, *grads) if not x.requires_grad else tuple(grads)


class _Checkpointed(torch.autograd.Function):
    """A segment run without saving its activations; its backward asks the stage's
    :class:`Recomputation` (``pending.owner``) for the rebuilt graph's gradients."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, pending: _Pending, *parameters: Tensor) -> Tensor:  # type: ignore[override]
        ctx.pending = pending
        ctx.save_for_backward(x)
        with torch.no_grad():
            return pending.run(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        pending: _Pending = ctx.pending
        x_grad, *parameter_grads = pending.owner.backward(pending, grad)
        return (x_grad, None, *parameter_grads)

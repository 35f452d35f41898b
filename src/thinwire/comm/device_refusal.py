"""A step refused on the device: no host wait for a GPU step's finiteness verdict.

On a GPU the exchange's verdict (did some rank's gradients hold a NaN or an infinity?) is a
device flag; reading it makes the host wait for the GPU once a step. Where the optimizer
can skip a step on the device (PyTorch's fused optimizers take a ``found_inf`` tensor, the
one ``GradScaler`` hands them), nothing needs reading: the memory and the compressor put
their state back wherever the flag is set (``torch.where``), the optimizer skips its step
where it is set, and the host learns of it later, from a copy of the flag in pinned memory
that it looks at without waiting, and warns (:class:`~thinwire.errors.NonFiniteGradientWarning`).
The optimizer's first step still reads the verdict on the host (a fused SGD that skips its
first step leaves its momentum buffers unwritten).
"""

from __future__ import annotations

import collections
import warnings
from typing import Any

import torch
from torch import Tensor

from thinwire.errors import NonFiniteGradientWarning


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` can skip a step on the device (fused: ``found_inf``)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


class DeviceRefusal:
    """Refuses a GPU step on the device through ``optimizer`` (a fused one), and reports
    each refused step once the host sees it, in :attr:`refused_steps` and a warning."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        if not skips_on_device(optimizer):
            raise ValueError(
                f"{type(optimizer).__name__} cannot skip a step on the device: build it with "
                "fused=True (Adam, AdamW, SGD, Adagrad), or register with refusal='host'"
            )
        self.optimizer = optimizer
        #: the steps refused on the device that the host has seen, in order
        self.refused_steps: list[int] = []
        #: the last settled step's flag, until the optimizer's step takes it
        self.flag: Tensor | None = None
        self._reports: collections.deque[tuple[int, Tensor, Any]] = collections.deque()
        self._stepped = False
        self._ours: tuple[bool, Any] | None = None
        self._hooks = [
            optimizer.register_step_pre_hook(self._before_step),
            optimizer.register_step_post_hook(self._after_step),
        ]

    @property
    def ready(self) -> bool:
        """Whether the optimizer has taken a step since (its state exists)."""
        return self._stepped

    def settle(self, step: int, flags: list[Tensor]) -> Tensor:
        """The step's flag (whether some flag of ``flags`` is set), for the optimizer, and a
        copy of it on its way to the host; nothing is read."""
        flags = [flag.reshape(()).bool() for flag in flags]  # a payload's flag may be uint8
        refused = flags[0] if len(flags) == 1 else torch.stack(flags).any()
        if refused.device.type == "cuda":
            seen = torch.empty((), dtype=torch.bool, pin_memory=True)
            seen.copy_(refused, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            seen, event = refused, None
        self._reports.append((step, seen, event))
        self.flag = refused
        return refused

    def poll(self) -> None:
        """Report every refused step whose verdict has reached the host, without waiting."""
        while self._reports:
            step, seen, event = self._reports[0]
            if event is not None and not event.query():
                return
            self._reports.popleft()
            if bool(seen):
                self.refused_steps.append(step)
                warnings.warn(
                    NonFiniteGradientWarning(
                        f"step {step} was skipped on every rank: some rank's gradients held a "
                        "NaN or an infinity. It was decided on the GPU, so the optimizer and "
                        "thinwire's state were left as they were, and this warning comes "
                        "when the host sees it, without waiting. Lower the learning rate, "
                        "clip gradients, or check the loss and the input data; register "
                        "with refusal='host' to raise NonFiniteGradientError at the step."
                    ),
                    stacklevel=2,
                )

    def close(self) -> None:
        """Take the hooks off the optimizer."""
        for hook in self._hooks:
            hook.remove()

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.flag is None:
            return
        found = self.flag.to(torch.float32)
        had = hasattr(optimizer, "found_inf")
        earlier = getattr(optimizer, "found_inf", None)  # a GradScaler's, if it set one
        self._ours = (had, earlier)
        optimizer.found_inf = found if earlier is None else earlier + found.to(earlier.device)

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._stepped = True
        self.flag = None
        if self._ours is None:
            return
        had, earlier = self._ours
        self._ours = None
        if had:
            optimizer.found_inf = earlier
        else:
            del optimizer.found_inf


#: the ways a GPU step with a non-finite gradient can be refused (``register``'s and
#: ``DistributedOptimizer``'s ``refusal``)
REFUSALS = ("auto", "device", "host")


def check_refusal(refusal: str) -> None:
    """Refuse a ``refusal`` that is none of :data:`REFUSALS`, saying which there are."""
    if refusal not in REFUSALS:
        raise ValueError(f"refusal must be one of {', '.join(REFUSALS)}, got {refusal!r}")


def device_refusal(
    refusal: str, optimizer: torch.optim.Optimizer | None, engine: Any
) -> DeviceRefusal | None:
    """What refuses ``engine``'s (a :class:`~thinwire.comm.engine.GradientExchange`) GPU
    steps on the device under ``refusal`` (``None``: the host reads the verdict);
    ``"device"`` that cannot be is refused with the reason."""
    check_refusal(refusal)
    able = engine.compressor.undoes_on_device and engine.memory.undoes_on_device
    fused = optimizer is not None and skips_on_device(optimizer)
    if refusal == "device" and not (fused and able):
        why = (
            f"{engine.compressor.name} cannot undo a step on the device"
            if not able
            else "it needs optimizer= a fused optimizer (fused=True: Adam, AdamW, SGD, "
            "Adagrad), which can skip a step on the device"
        )
        raise ValueError(f"refusal='device': {why}; use refusal='host' or 'auto'")
    if refusal == "host" or not (fused and able):
        return None
    assert optimizer is not None
    return DeviceRefusal(optimizer)

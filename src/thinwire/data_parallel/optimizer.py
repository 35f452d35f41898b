"""The front end for code without DDP: wrap the optimizer.

    opt = thinwire.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        model, "powersgd", rank=2)
    loss.backward(); opt.step(); opt.zero_grad()

At construction the wrapper checks that every rank has the same parameters and compressor
setup and broadcasts rank 0's parameters. ``step()`` averages the gradients through the
compressor, bucket by bucket (about ``bucket_cap_mb`` each, in reverse parameter order as
DDP does), then calls the wrapped optimizer; a compressor of several rounds sends each
bucket's later rounds with the next bucket's first (``fuse_rounds``, as the DDP hook
does). Call ``step()`` once per optimizer step: under gradient accumulation the exchange
and error feedback run once, not per backward.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from thinwire.comm.collectives import Communicator, sibling_group
from thinwire.comm.device_refusal import check_refusal, device_refusal
from thinwire.comm.engine import GradientExchange, GradientItem, StepStats
from thinwire.comm.gradients import gradient_of
from thinwire.comm.replicas import broadcast_where_different
from thinwire.compress.base import Compressor, Memory, check_flag, is_real
from thinwire.compress.registry import compressor as build_compressor
from thinwire.data_parallel.parameters import split_parameters


@dataclass
class StartedExchange:
    """An exchange of every gradient under way (:meth:`DistributedOptimizer.start_synchronize`):
    its buckets of gradients and the future of their averages."""

    buckets: list[list[GradientItem]]
    future: torch.futures.Future


class DistributedOptimizer:
    """Averages gradients through a thinwire compressor before each optimizer step.

    Args:
        optimizer: the local optimizer over the model's parameters.
        model: the model, or an iterable of ``(name, parameter)`` pairs.
        compressor: a registered name or a :class:`Compressor` instance.
        communicator: ``"auto"``, ``"allreduce"``, ``"allgather"`` or ``"direct"``.
        memory: override the compressor's default error-feedback memory.
        bucket_cap_mb: gradients are exchanged in buckets of about this size.
        fuse_rounds: send each bucket's later rounds in the collectives of the next
            bucket's first (``False``: each bucket's rounds alone).
        group: the process group; default: the global one.
        broadcast_parameters: copy rank 0's parameters to every rank at construction (the
            ranks compare digests first; only tensors that differ somewhere travel).
        own_group: run the exchange on a new process group of ``group``'s ranks (for
            exchanges that run in the background while the program issues collectives of
            its own, as :class:`~thinwire.DelayedAveraging`'s do).
        refusal: how a GPU step with a NaN or Inf gradient on some rank is refused, as in
            :func:`thinwire.register`: ``"host"`` (default here: the verdict read once a
            step, :class:`~thinwire.errors.NonFiniteGradientError` raised by :meth:`step`),
            ``"device"`` (``optimizer`` a fused one: skipped on the GPU, no host wait,
            warned later) or ``"auto"`` (``"device"`` where it can be).
        **options: compressor options when ``compressor`` is a name.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: nn.Module | Iterable[tuple[str, nn.Parameter]],
        compressor: str | Compressor = "none",
        *,
        communicator: str | Communicator = "auto",
        memory: Memory | None = None,
        bucket_cap_mb: float = 25.0,
        fuse_rounds: bool = True,
        group: dist.ProcessGroup | None = None,
        broadcast_parameters: bool = True,
        own_group: bool = False,
        refusal: str = "host",
        **options: Any,
    ) -> None:
        check_first_order(optimizer)
        if not (is_real(bucket_cap_mb) and bucket_cap_mb > 0):
            raise ValueError(f"bucket_cap_mb must be a number > 0, got {bucket_cap_mb!r}")
        check_flag("fuse_rounds", fuse_rounds)
        check_flag("broadcast_parameters", broadcast_parameters)
        check_flag("own_group", own_group)
        check_refusal(refusal)
        built = build_compressor(compressor, **options)
        built.check_optimizer(optimizer)
        # less the tables thinwire.data_parallel.sparse shards (DDP's ignore list): each
        # rank's differs
        self.parameters, self._frozen = split_parameters(model)
        if not self.parameters:
            raise ValueError("the model has no parameters that require gradients")
        self.optimizer = optimizer
        exchange_group = sibling_group(group) if own_group else group
        self.engine = GradientExchange(
            built, communicator=communicator, memory=memory, group=exchange_group
        )
        self.engine.verify(self.parameters)
        self.engine.device_refusal = device_refusal(refusal, optimizer, self.engine)
        if broadcast_parameters:  # rank 0's weights everywhere, sending only what differs
            root = dist.get_global_rank(group, 0) if group else 0
            broadcast_where_different([(n, p.data) for n, p in self.parameters], root, group)
        self.buckets = _buckets(self.parameters, int(bucket_cap_mb * 2**20))
        self.fuse_rounds = fuse_rounds

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's parameter groups (learning-rate schedulers use these)."""
        return self.optimizer.param_groups

    @property
    def last_step(self) -> StepStats | None:
        """Statistics of the last exchange."""
        return self.engine.last_step

    def check_requires_grad_unchanged(self) -> None:
        """Refuse a parameter whose ``requires_grad`` changed since construction: one
        unfrozen would train on this rank's own gradients (the ranks drift apart), and one
        frozen would still be stepped, with zeros (momentum and weight decay move it)."""
        unfrozen = [name for name, p in self._frozen if p.requires_grad]
        frozen = [name for name, p in self.parameters if not p.requires_grad]
        if unfrozen or frozen:
            changed = unfrozen or frozen
            raise ValueError(
                f"parameter(s) {', '.join(changed[:5])}{' ...' if len(changed) > 5 else ''} "
                f"{'now require' if unfrozen else 'no longer require'} gradients, but "
                f"{'did not' if unfrozen else 'did'} when thinwire was built: "
                + (
                    "they are not averaged, and the ranks would drift apart. "
                    if unfrozen
                    else "they would still be stepped with zero gradients. "
                )
                + "Build the wrapper again after changing requires_grad (with "
                "DelayedAveraging, flush() first)"
            )

    def synchronize(self) -> None:
        """Average every gradient over the ranks, in place. Parameters without a gradient
        on this rank contribute zeros, so every rank issues the same collectives (a rank
        with nothing to learn from, e.g. out of data, can still take part). A parameter no
        rank gave a gradient is then stepped with zeros, so its momentum and weight decay
        still act, where a local optimizer would skip it: build the wrapper over the
        parameters that train (``requires_grad=False`` on those that never do)."""
        self.finish_synchronize(self.start_synchronize())

    def start_synchronize(self) -> StartedExchange:
        """Start averaging every gradient on the exchange thread and return at once; the
        gradients must stay untouched until :meth:`finish_synchronize` (which
        :meth:`synchronize` calls at once) has written the averages into them."""
        self.check_requires_grad_unchanged()
        buckets = []
        for bucket in self.buckets:
            items = []
            for name, p in bucket:
                items.append(GradientItem(name, gradient_of(name, p), p))
            buckets.append(items)
        return StartedExchange(buckets, self.engine.submit(lambda: self._exchange(buckets)))

    def finish_synchronize(self, started: StartedExchange) -> None:
        """Wait for the exchange :meth:`start_synchronize` began and write the averages
        into the gradients (an exchange's error is raised here)."""
        means = started.future.wait()
        for items, bucket_means in zip(started.buckets, means, strict=True):
            for item, mean in zip(items, bucket_means, strict=True):
                item.grad.copy_(mean)

    def _exchange(self, buckets: list[list[GradientItem]]) -> list[list[torch.Tensor]]:
        """Every bucket's means, in bucket order (on the engine's thread; the last bucket
        closes the step)."""
        means: dict[int, list[torch.Tensor]] = {}
        for index, items in enumerate(buckets):
            last = index == len(buckets) - 1
            means.update(
                self.engine.exchange_bucket(items, index, last=last, fuse=self.fuse_rounds)
            )
        return [means[index] for index in range(len(buckets))]

    def step(self, closure: Callable[[], float] | None = None) -> Any:
        """Evaluate ``closure`` (if any), average the gradients, then step the optimizer."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.synchronize()
        self.optimizer.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients (as the wrapped optimizer does)."""
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state and thinwire's (residuals, momenta, Q, RNG, step)."""
        return {"optimizer": self.optimizer.state_dict(), "thinwire": self.engine.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        if set(state) != {"optimizer", "thinwire"}:
            raise ValueError(
                "not a thinwire.DistributedOptimizer state dict (expected keys 'optimizer' "
                f"and 'thinwire', got {sorted(state)})"
            )
        self.engine.check_state(state["thinwire"])  # before anything changes
        self.optimizer.load_state_dict(state["optimizer"])
        self.engine.load_state_dict(state["thinwire"])


def _buckets(
    parameters: list[tuple[str, nn.Parameter]], cap_bytes: int
) -> list[list[tuple[str, nn.Parameter]]]:
    """Split parameters, last first (the order backward produces them), into buckets of
    at most ``cap_bytes`` (a larger parameter gets a bucket of its own)."""
    buckets: list[list[tuple[str, nn.Parameter]]] = [[]]
    size = 0
    for name, p in reversed(parameters):
        nbytes = p.numel() * p.element_size()
        if buckets[-1] and size + nbytes > cap_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append((name, p))
        size += nbytes
    return buckets


def check_first_order(optimizer: Any) -> None:
    """Refuse what thinwire cannot wrap: anything but a ``torch.optim.Optimizer``, and
    optimizers whose step needs a closure (L-BFGS re-evaluates the loss, and so the
    gradients, several times within one step; thinwire averages one gradient per step)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer)}")
    closure = inspect.signature(optimizer.step).parameters.get("closure")
    if closure is not None and closure.default is inspect.Parameter.empty:
        raise TypeError(
            f"{type(optimizer).__name__}.step() needs a closure: it re-evaluates the loss and "
            "the gradients within one step, and thinwire averages one gradient per step. "
            "Use a first-order optimizer (SGD, Adam, ...)"
        )

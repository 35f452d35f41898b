"""Measure one worker's compute in this process, on one thread: forward, backward and
optimizer time of a model on a batch (median of a few runs after warm-up), and when each
parameter's gradient is ready during the backward pass (which decides how much
communication can overlap it)."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from thinwire.plan.cost import ComputeTime


@dataclass(frozen=True)
class ComputeProfile:
    """One worker's compute: the phase times, and for each parameter the fraction of the
    backward pass after which its gradient is ready (``ready``), in ready ``order``."""

    time: ComputeTime
    ready: Mapping[str, float]
    order: tuple[str, ...]


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Run the block with one intra-op thread (as every benchmark worker does)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def measure_compute(
    model: nn.Module,
    batch: tuple[Tensor, Tensor],
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    *,
    optimizer: torch.optim.Optimizer | None = None,
    repeats: int = 5,
    warmup: int = 2,
) -> ComputeProfile:
    """Time forward, backward and optimizer step of ``model`` on ``batch`` (medians of
    ``repeats`` runs after ``warmup``), on one thread. The model is trained by the runs
    (default optimizer: SGD, lr 0.01, momentum 0.9)."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got {repeats} and {warmup}")
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise ValueError("the model has no parameters that require gradients")
    opt = optimizer or torch.optim.SGD([p for _, p in named], lr=0.01, momentum=0.9)
    stamps: dict[str, float] = {}

    def stamper(name: str) -> Callable[[Tensor], None]:
        def stamp(_: Tensor) -> None:
            stamps.setdefault(name, time.perf_counter())

        return stamp

    handles = [p.register_post_accumulate_grad_hook(stamper(name)) for name, p in named]
    x, y = batch
    phases: list[tuple[float, float, float]] = []
    ready: dict[str, list[float]] = {name: [] for name, _ in named}
    orders: list[tuple[str, ...]] = []
    model.train()
    try:
        with one_thread():
            for run in range(warmup + repeats):
                opt.zero_grad(set_to_none=True)
                stamps.clear()
                t0 = time.perf_counter()
                loss = loss_fn(model(x), y)
                t1 = time.perf_counter()
                loss.backward()
                t2 = time.perf_counter()
                opt.step()
                t3 = time.perf_counter()
                if run < warmup:
                    continue
                phases.append((t1 - t0, t2 - t1, t3 - t2))
                for name, _ in named:  # unused parameters: ready at the end
                    ready[name].append(min(1.0, (stamps.get(name, t2) - t1) / (t2 - t1)))
                orders.append(tuple(sorted(stamps, key=stamps.__getitem__)))
    finally:
        for handle in handles:
            handle.remove()
        opt.zero_grad(set_to_none=True)
    forward, backward, step = (statistics.median(p[i] for p in phases) for i in range(3))
    order = orders[-1] + tuple(n for n, _ in reversed(named) if n not in orders[-1])
    return ComputeProfile(
        ComputeTime(forward, backward, step),
        {name: statistics.median(values) for name, values in ready.items()},
        order,
    )

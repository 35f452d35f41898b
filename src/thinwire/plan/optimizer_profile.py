"""The optimizer step, timed on the gradients a data-parallel method hands it.

What an optimizer step costs can depend on the values it is given, not only their size.
On this project's test machine (an AMD EPYC core, PyTorch's AVX-512 kernels) ``sqrt`` of
a zero runs 4.6 times slower than of a positive number, and Adam takes the square root of
its second moment, which stays exactly zero wherever no gradient has yet arrived. A
sparsifier (DGC, top-k) averages to gradients that are zero almost everywhere, so much of
the moment stays zero for many steps: AdamW stepped 2.3 times slower on a 27 M-parameter
model after ten DGC exchanges at density 0.01 than after dense ones (one process), and
the 8-rank runs' optimizer step was 0.42-0.49 s with DGC against 0.24 s dense, as late
as the 45th step (the longest run measured). The planner therefore times the step after
the method's own exchange has written the gradients (:func:`optimizer_step_s` with
:func:`exchanged_gradients`), where a machine without that penalty shows none.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

#: the optimizers the profiler times, by the names ``thinwire bench --optimizer`` takes
OPTIMIZERS = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}

#: per step (from 0), the gradients of each parameter
Gradients = Callable[[int], Sequence[Tensor]]

Shapes = Sequence[tuple[int, ...]]


def optimizer_step_s(
    optimizer: str, shapes: Shapes, repeats: int, gradients: Gradients | None = None
) -> tuple[float, int]:
    """The median seconds of ``optimizer``'s step over parameters of ``shapes`` (the first
    step, which allocates the state, left out), and its state's bytes. ``gradients``: what
    each step is given (default: fresh normal values, as a dense exchange hands on)."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"the profiler times {', '.join(OPTIMIZERS)}, not {optimizer!r}")
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in shapes]
    options = {"momentum": 0.9} if optimizer == "sgd" else {}
    step = OPTIMIZERS[optimizer](params, lr=1e-3, **options)
    times = []
    for run in range(repeats + 1):
        given = gradients(run) if gradients is not None else [torch.randn_like(p) for p in params]
        for p, grad in zip(params, given, strict=True):
            p.grad = grad
        start = time.perf_counter()
        step.step()
        times.append(time.perf_counter() - start)
    state = sum(
        v.numel() * v.element_size()
        for per_param in step.state.values()
        for v in per_param.values()
        if isinstance(v, torch.Tensor)
    )
    return statistics.median(times[1:]), state


def exchanged_gradients(
    compressor: str, options: Mapping[str, Any], shapes: Shapes, world_size: int, seed: int = 0
) -> Gradients:
    """Per step, the averages thinwire's engine hands the optimizer when ``world_size``
    ranks exchange fresh random gradients of ``shapes`` with ``compressor`` (one bucket;
    every rank sends what this one does, as in :mod:`thinwire.plan.profile_exchangers`).
    Past the compressor's density warm-up, as the profile's exchanges are."""
    from thinwire.plan.profile_buckets import Bucket
    from thinwire.plan.profile_exchangers import build_exchanger

    exchanger = build_exchanger("thinwire", compressor, options, world_size, fuse_rounds=True)
    bucket = Bucket(0, [(f"p{i}", torch.zeros(shape)) for i, shape in enumerate(shapes)])
    generator = torch.Generator().manual_seed(seed)

    def gradients(run: int) -> list[Tensor]:
        bucket.fill(generator)
        exchanger(bucket, run, True)
        return [view.clone() for view in bucket.views]

    return gradients

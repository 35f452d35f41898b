"""Profile a model for the cost model: measure what it needs, in this process, on one thread.

- :func:`profile_model` / :func:`profile_task`: a model's (or a task's) compute profile
  and every requested method's traffic and compression time, as a :class:`Profile` that
  predicts each method's step on a link.
- :func:`measure_compute` (:mod:`thinwire.plan.profile_compute`): forward, backward and
  optimizer time, and when each parameter's gradient is ready during the backward pass.
- :func:`ddp_buckets`, :func:`bucket_groups` (:mod:`thinwire.plan.profile_buckets`):
  DDP's gradient buckets.
- :func:`measure_method` (:mod:`thinwire.plan.profile_method`): per bucket, the
  collectives a method issues and the CPU time of its compression and decompression,
  through the exchangers of :mod:`thinwire.plan.profile_exchangers`.

No ``torch.distributed`` process group is needed: collectives are answered locally (a sum
is ``world_size`` copies of this rank's payload, a gather ``world_size`` payloads).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from thinwire.data_parallel.buckets import BucketSpec
from thinwire.plan.cost import ComputeTime, MethodCost, StepPrediction, predict_step
from thinwire.plan.embedding import TableLookups, measure_lookups
from thinwire.plan.network import Link
from thinwire.plan.profile_buckets import (
    BUCKET_CAP_MB,
    FIRST_BUCKET_MB,
    NamedTensors,
    bucket_groups,
    ddp_buckets,
)
from thinwire.plan.profile_compute import ComputeProfile, measure_compute, one_thread
from thinwire.plan.profile_method import measure_method
from thinwire.strategies import strategy

#: how many steps of every rank's batches the embedding lookups are measured on
LOOKUP_STEPS = 4


@dataclass(frozen=True)
class Profile:
    """A model's compute profile and every requested method's traffic, for one world size."""

    compute: ComputeProfile
    costs: dict[str, MethodCost]
    world_size: int

    def predict(
        self,
        method: str,
        link: Link,
        *,
        compute: ComputeTime | float | None = None,
        overlap: bool = True,
        cpu_scale: float | None = None,
    ) -> StepPrediction:
        """Predict ``method``'s step on ``link`` for :attr:`world_size` workers.

        ``compute``: one worker's compute measured on the real cluster, as phases
        (:class:`ComputeTime`) or as the compute-only step time in seconds (the ``local``
        run's median step; the profiled phases are scaled to it). It replaces the profiled
        compute and scales the profiled compression times by the same factor (workers that
        share CPUs are slower at both). Default: this process's profile as it is.

        ``cpu_scale``: scale the compression times by this factor instead, where the
        workers' compute does not run on the CPU that compresses (an accelerator, or
        ``thinwire bench --compute sleep``'s virtual one, whose speed says nothing of the
        CPU's): the workers' CPU seconds of a forward and backward pass over this
        process's.
        """
        if cpu_scale is not None and not (cpu_scale > 0 and math.isfinite(cpu_scale)):
            raise ValueError(f"cpu_scale must be a finite factor > 0, got {cpu_scale!r}")
        if method not in self.costs:
            raise ValueError(f"method {method!r} was not profiled; profiled: {list(self.costs)}")
        cost = self.costs[method]
        profiled = self.compute.time
        if isinstance(compute, (int, float)):
            if not (compute > 0 and math.isfinite(compute)):
                raise ValueError(f"compute step time must be > 0 s, got {compute!r}")
            compute = profiled.scaled(compute / profiled.total)
        if compute is not None:
            if cpu_scale is None and profiled.total > 0 and compute.total > 0:
                cost = cost.scaled(compute.total / profiled.total)
            profiled = compute
        if cpu_scale is not None:
            cost = cost.scaled(cpu_scale)
        return predict_step(profiled, cost, link, self.world_size, overlap=overlap)


def profile_model(
    model: nn.Module,
    batch: tuple[Tensor, Tensor],
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    methods: Mapping[str, Mapping[str, Any] | None],
    *,
    world_size: int,
    repeats: int = 5,
    method_repeats: int = 3,
    bucket_cap_mb: BucketSpec = BUCKET_CAP_MB,
    fuse_rounds: bool = True,
    broadcast_buffers: bool = True,
    lookups: Sequence[TableLookups] | None = None,
) -> Profile:
    """Measure ``model``'s compute on ``batch`` and each method's traffic and compression
    time (``methods``: name -> options) for ``world_size`` workers (``fuse_rounds``: see
    :func:`measure_method`; ``broadcast_buffers``: DDP's option of that name, whose
    broadcast of the model's buffers before each forward pass the DDP methods pay;
    ``lookups``: the embedding tables' lookups, for the embedding methods)."""
    for name, opts in methods.items():
        strategy(name).options(opts)  # fail fast, before the slow part
        if strategy(name).embedding and lookups is None:
            raise ValueError(
                f"{name!r} needs the tables' lookups: pass lookups= "
                "(thinwire.plan.embedding.measure_lookups), or use profile_task"
            )
    compute = measure_compute(model, batch, loss_fn, repeats=repeats)
    params = [(n, p.detach()) for n, p in model.named_parameters() if p.requires_grad]
    buffer_bytes = (
        sum(b.numel() * b.element_size() for b in model.buffers()) if broadcast_buffers else 0
    )
    costs = {
        name: measure_method(
            name,
            params,
            world_size=world_size,
            options=opts,
            compute=compute,
            bucket_cap_mb=bucket_cap_mb,
            repeats=method_repeats,
            fuse_rounds=fuse_rounds,
            broadcast_bytes=buffer_bytes,
            lookups=lookups,
        )
        for name, opts in methods.items()
    }
    return Profile(compute, costs, world_size)


def profile_task(
    task: Any,
    methods: Mapping[str, Mapping[str, Any] | None],
    *,
    world_size: int,
    repeats: int = 5,
    method_repeats: int = 3,
    **options: Any,
) -> Profile:
    """:func:`profile_model` for a :class:`thinwire.tasks.Task` (rank 0's first batch);
    ``options`` go to :func:`profile_model` (``bucket_cap_mb``, ``broadcast_buffers``).
    For the embedding methods, every rank's lookups are measured on its first batches."""
    model = task.build_model()
    batch = task.batch(0, world_size, 0)
    if any(strategy(name).embedding for name in methods):
        options.setdefault("lookups", task_lookups(task, model, world_size))
    return profile_model(
        model,
        batch,
        task.loss,
        methods,
        world_size=world_size,
        repeats=repeats,
        method_repeats=method_repeats,
        **options,
    )


def task_lookups(
    task: Any, model: nn.Module, world_size: int, steps: int = LOOKUP_STEPS
) -> list[TableLookups]:
    """The embedding lookups of ``task``'s first ``steps`` batches on every rank."""
    batches = [[task.batch(r, world_size, s)[0] for r in range(world_size)] for s in range(steps)]
    return measure_lookups(model, batches, world_size)


__all__ = [
    "BUCKET_CAP_MB",
    "FIRST_BUCKET_MB",
    "LOOKUP_STEPS",
    "ComputeProfile",
    "NamedTensors",
    "Profile",
    "bucket_groups",
    "ddp_buckets",
    "measure_compute",
    "measure_method",
    "one_thread",
    "profile_model",
    "profile_task",
    "task_lookups",
]

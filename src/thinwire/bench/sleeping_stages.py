"""Pipeline stages that sleep their measured compute and replay their tensor-parallel
collectives: the virtual accelerators of ``thinwire bench --plans --compute sleep``.

A trainer built by :func:`thinwire.parallelize` keeps everything but its stages' math: the
mesh, the pipeline schedule and its sends, the loss and its all-reduces, the data-parallel
engine and its compressor, the optimizer. Each stage's forward becomes: for each
collective :mod:`thinwire.plan.stage_profile` noted, sleep the compute before it, then
all-reduce a tensor of its shape on the real ``"tp"`` group; then sleep the tail and
return zeros of the real output's shape. Its backward does the same with the backward
profile and hands each parameter the gradient one real step produced (so compressors see
real gradients). The CPU stays free while the "accelerator" works, as on a GPU host.

A recomputing stage sleeps its checkpointed blocks' forward again (with their collectives)
inside the backward, or earlier where the schedule has a recompute action. A plan with
sub-batches replays each pass once per sub-batch, in the turns
:mod:`thinwire.parallel.subpipeline` takes (its profile is one sub-batch's): a sub-batch
sleeps to its next all-reduce, starts it and hands on; it waits for that all-reduce when
its turn comes round.

Timings only: every step applies the same gradients, so the losses say nothing.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from thinwire.parallel.stages import StageModule
from thinwire.plan.stage_profile import Pass, StageProfile


def replay(profile_pass: Pass, group: dist.ProcessGroup | None, parts: int = 1) -> None:
    """Sleep each gap and run each collective of ``profile_pass`` on ``group``, for each
    of ``parts`` sub-batches in turns."""
    if profile_pass.collectives and group is None:
        raise RuntimeError(
            "the profile has tensor-parallel all-reduces but the plan has tp=1: "
            "profile the plan it runs"
        )
    pending: list[dist.Work | None] = [None] * parts
    for collective in profile_pass.collectives:
        for part in range(parts):
            if pending[part] is not None:
                pending[part].wait()
            time.sleep(collective.gap_s)
            tensor = torch.zeros(collective.shape, dtype=collective.torch_dtype)
            pending[part] = dist.all_reduce(tensor, group=group, async_op=True)
    for part in range(parts):
        if pending[part] is not None:
            pending[part].wait()
        time.sleep(profile_pass.tail_s)


class _SleepingStage(torch.autograd.Function):
    """The stage's output (zeros) after its forward replay; on the way back, its backward
    replay, the recorded gradients added to the parameters' and zeros for the input."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: Tensor, anchor: Tensor, sleeper: SleepingStage
    ) -> Tensor:
        ctx.sleeper = sleeper
        ctx.input_shape, ctx.input_dtype = x.shape, x.dtype
        profile = sleeper.profile
        with sleeper.noting("F"):
            replay(profile.forward, sleeper.group, profile.subbatches)
        return torch.zeros(profile.output_shape, dtype=getattr(torch, profile.output_dtype[6:]))

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None, None]:  # type: ignore[override]
        sleeper: SleepingStage = ctx.sleeper
        sleeper.recompute_before_backward()
        with sleeper.noting("B"):
            replay(sleeper.profile.backward, sleeper.group, sleeper.profile.subbatches)
        sleeper.accumulate_gradients()
        if not ctx.input_dtype.is_floating_point:  # tokens
            return None, None, None
        return torch.zeros(ctx.input_shape, dtype=ctx.input_dtype), None, None


class SleepingStage:
    """Makes ``stage`` sleep through ``profile`` (its forward is replaced in place) and
    hand back ``gradients`` (per parameter, for one micro-batch)."""

    def __init__(
        self,
        stage: StageModule,
        profile: StageProfile,
        gradients: dict[int, Tensor],
        group: dist.ProcessGroup | None,
    ) -> None:
        self.stage, self.profile, self.group = stage, profile, group
        self.gradients = gradients
        self.parameters = [p for p in stage.parameters() if id(p) in gradients]
        self.anchor = torch.zeros((), requires_grad=True)
        self.recomputed_ahead = 0
        self.events: list[tuple[str, float, float]] = []
        """What the accelerator ran: ``("F" | "R" | "B", start, end)``, perf_counter s."""
        stage.forward = self.forward  # type: ignore[method-assign]
        stage.recompute_next = self.recompute_next  # type: ignore[method-assign]

    def recompute_next(self) -> bool:
        """A schedule's recompute action: the checkpointed blocks' forward, slept and
        replayed; the next backward then does not recompute."""
        if self.profile.recompute is None:
            return False
        with self.noting("R"):
            replay(self.profile.recompute, self.group, self.profile.subbatches)
        self.recomputed_ahead += 1
        return True

    @contextlib.contextmanager
    def noting(self, kind: str) -> Iterator[None]:
        """Note the time the block takes as a ``kind`` compute in :attr:`events`."""
        start = time.perf_counter()
        yield
        self.events.append((kind, start, time.perf_counter()))

    def recompute_before_backward(self) -> None:
        """Recompute inside the backward unless a recompute action did already."""
        if self.recomputed_ahead:
            self.recomputed_ahead -= 1
        elif self.profile.recompute is not None:
            with self.noting("R"):
                replay(self.profile.recompute, self.group, self.profile.subbatches)

    def forward(self, x: Tensor) -> Tensor:
        """What the stage would return, after the stage's time."""
        if x.device.type == "meta":  # the schedule's shape inference: no time, no traffic
            return torch.zeros(self.profile.output_shape, device="meta")
        return _SleepingStage.apply(x, self.anchor, self)

    def accumulate_gradients(self) -> None:
        """Add one micro-batch's gradient to every parameter."""
        for p in self.parameters:
            g = self.gradients[id(p)]
            p.grad = g.clone() if p.grad is None else p.grad + g


def capture_gradients(trainer: Any, inputs: Tensor, targets: Tensor) -> dict[int, Tensor]:
    """One real forward and backward of this rank's slice of the global batch (no
    exchange, no optimizer step): each parameter's gradient per micro-batch, by ``id``."""
    x, y = trainer._slice(inputs, targets)
    trainer.optimizer.zero_grad(set_to_none=True)
    trainer.pipeline.train(x, y)
    trainer._shard_gradients()
    trainer.tied.sum_gradients()
    gradients = {
        id(p): p.grad.detach() / trainer.plan.microbatches
        for _, p in trainer.named_parameters()
        if p.grad is not None
    }
    trainer.optimizer.zero_grad(set_to_none=True)
    return gradients


def sleep_stages(
    trainer: Any, profiles: list[StageProfile], gradients: dict[int, Tensor]
) -> list[SleepingStage]:
    """Make every stage of ``trainer`` sleep through its profile (by stage index)."""
    group = trainer.mesh["tp"].get_group() if trainer.plan.tp > 1 else None
    by_index = {profile.index: profile for profile in profiles}
    pp_rank = trainer.mesh["pp"].get_local_rank()
    sleepers = []
    for k, stage in enumerate(trainer.stages):
        index = pp_rank + k * trainer.plan.pp
        sleepers.append(SleepingStage(stage, by_index[index], gradients, group))
    return sleepers

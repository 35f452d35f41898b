"""Pipeline parallelism: this rank's stages run under one of PyTorch's schedules
(``torch.distributed.pipelining``: GPipe, 1F1B, interleaved 1F1B), or thinwire's shifted 1F1B
(:mod:`thinwire.parallel.program_schedule`), over the ``"pp"`` group.

A :class:`Pipeline` runs one data-parallel slice of a batch, cut into micro-batches: it
leaves each parameter's gradient as the mean over the slice (the loss is a mean per
micro-batch and the schedules divide by their number) and returns the slice's mean loss on
the ranks that hold the last stage. Without pipeline parallelism the same is gradient
accumulation over the micro-batches on one stage.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)

from thinwire.parallel.loss import LossFn
from thinwire.parallel.plan import ParallelPlan
from thinwire.parallel.program_schedule import ProgramSchedule
from thinwire.parallel.stages import StageModule

SCHEDULE_CLASSES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved-1f1b": ScheduleInterleaved1F1B,
}
#: schedules PyTorch does not have, run from their programs (:class:`ProgramSchedule`)
PROGRAMS_ONLY = ("shifted-1f1b",)


class Pipeline:
    """Runs a slice of the batch through this rank's stages (base: one stage, no
    pipeline parallelism, gradient accumulation over micro-batches)."""

    def __init__(self, stages: Sequence[StageModule], microbatches: int, loss: LossFn) -> None:
        self.stages = list(stages)
        self.microbatches = microbatches
        self.loss = loss

    @property
    def holds_first(self) -> bool:
        """Whether this rank runs the first stage (it takes the tokens)."""
        return any(stage.first for stage in self.stages)

    @property
    def holds_last(self) -> bool:
        """Whether this rank runs the last stage (it has the loss)."""
        return any(stage.last for stage in self.stages)

    def train(self, inputs: Tensor, targets: Tensor) -> Tensor | None:
        """Forward and backward over the slice; its mean loss (last stage only)."""
        (stage,) = self.stages
        total = torch.zeros(())
        for x, y in zip(
            inputs.chunk(self.microbatches), targets.chunk(self.microbatches), strict=True
        ):
            loss = self.loss(stage(x), y)
            (loss / self.microbatches).backward()
            total += loss.detach()
        return total / self.microbatches

    def evaluate(self, inputs: Tensor, targets: Tensor) -> Tensor | None:
        """The slice's mean loss without gradients (last stage only)."""
        (stage,) = self.stages
        with torch.no_grad():
            losses = [
                self.loss(stage(x), y)
                for x, y in zip(
                    inputs.chunk(self.microbatches), targets.chunk(self.microbatches), strict=True
                )
            ]
        return torch.stack(losses).mean()


class ScheduledPipeline(Pipeline):
    """This rank's stages of a pipeline over the ``"pp"`` group, under a PyTorch schedule."""

    def __init__(
        self,
        stages: Sequence[StageModule],
        indices: Sequence[int],
        plan: ParallelPlan,
        mesh: DeviceMesh,
        loss: LossFn,
    ) -> None:
        super().__init__(stages, plan.microbatches, loss)
        group = mesh.get_group()
        device = torch.device("cpu")
        self.pipeline_stages = [
            PipelineStage(stage, index, plan.chunks, device, group=group)
            for stage, index in zip(stages, indices, strict=True)
        ]
        if plan.schedule in PROGRAMS_ONLY:
            (stage, module) = (self.pipeline_stages[0], self.stages[0])
            self.schedule = ProgramSchedule(
                stage,
                plan.microbatches,
                plan.schedule,
                loss_fn=loss,
                # looked up at each call: virtual accelerators replace it
                recompute=(lambda: module.recompute_next()) if module.checkpointed else None,
            )
            return
        schedule_class = SCHEDULE_CLASSES[plan.schedule]
        if plan.schedule == "interleaved-1f1b":
            self.schedule = schedule_class(self.pipeline_stages, plan.microbatches, loss_fn=loss)
        else:
            (stage,) = self.pipeline_stages
            self.schedule = schedule_class(stage, plan.microbatches, loss_fn=loss)

    def _run(self, run: object, inputs: Tensor, targets: Tensor) -> Tensor | None:
        losses: list[Tensor] = []
        args = (inputs,) if self.holds_first else ()
        target = targets if self.holds_last else None
        run(*args, target=target, losses=losses)  # type: ignore[operator]
        if not self.holds_last:
            return None
        return torch.stack([loss.detach() for loss in losses]).mean()

    def train(self, inputs: Tensor, targets: Tensor) -> Tensor | None:
        """Forward and backward over the slice under the schedule."""
        return self._run(self.schedule.step, inputs, targets)

    def evaluate(self, inputs: Tensor, targets: Tensor) -> Tensor | None:
        """Forward only, under the schedule's evaluation path."""
        with torch.no_grad():
            return self._run(self.schedule.eval, inputs, targets)


def apply_pipeline(
    stages: Sequence[StageModule],
    indices: Sequence[int],
    plan: ParallelPlan,
    mesh: DeviceMesh,
    loss: LossFn,
) -> Pipeline:
    """This rank's stages as a :class:`Pipeline` over ``mesh`` (the ``"pp"`` dimension):
    scheduled when ``pp > 1``, gradient accumulation otherwise."""
    if plan.pp == 1:
        return Pipeline(stages, plan.microbatches, loss)
    return ScheduledPipeline(stages, indices, plan, mesh, loss)

"""Runs a stage's schedule program (:mod:`thinwire.parallel.schedule_programs`) on
PyTorch's ``PipelineStage``: the runtime of the schedules PyTorch does not have, such as
1F1B with Merak's shifted critical path, whose recomputation is an action of its own.

Each action maps onto the stage's own operations: a posted receive or send starts the
stage's point-to-point operations for that micro-batch (``get_fwd_recv_ops`` and the
like), a wait waits for them, ``F`` runs ``forward_one_chunk`` (and the loss on the last
stage), ``R`` asks the stage module to rebuild its oldest checkpointed micro-batch
(:meth:`thinwire.parallel.recompute.Recomputation.recompute_next`; nothing when it has
none, or when the backward recomputes), ``B`` runs ``backward_one_chunk``. PyTorch's
schedule base class does the rest: splitting the batch, the stage's shape inference, the
losses, scaling the gradients by the number of micro-batches.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleSingle

from thinwire.parallel.schedule_programs import FWD, IN_BACKWARD, program


def _start(ops: list[dist.P2POp]) -> list[dist.Work]:
    """Post each point-to-point operation on its own (no coalescing: gloo runs them as
    they come)."""
    works = []
    for op in ops:
        if op.op is dist.isend:
            works.append(dist.isend(op.tensor, group=op.group, tag=op.tag, group_dst=op.group_peer))
        else:
            works.append(dist.irecv(op.tensor, group=op.group, tag=op.tag, group_src=op.group_peer))
    return works


class ProgramSchedule(PipelineScheduleSingle):
    """A single-stage pipeline schedule that runs ``schedule``'s program for its stage.

    ``recompute``: a callable rebuilding the stage's oldest checkpointed micro-batch (the
    ``R`` action), or ``None`` when the stage checkpoints nothing."""

    def __init__(
        self,
        stage: PipelineStage,
        n_microbatches: int,
        schedule: str,
        loss_fn: Any = None,
        recompute: Any = None,
    ) -> None:
        super().__init__(stage, n_microbatches, loss_fn=loss_fn)
        self.schedule_name = schedule
        self.recompute = recompute
        self.actions = program(
            schedule, stage.stage_index, stage.num_stages, n_microbatches, recompute is not None
        )

    def _ops(self, key: tuple[str, int, int], role: str) -> list[dist.P2POp]:
        direction, _, microbatch = key
        stage = self._stage
        if direction == FWD:
            return (
                stage.get_fwd_recv_ops(microbatch)
                if role == "recv"
                else stage.get_fwd_send_ops(microbatch)
            )
        return (
            stage.get_bwd_recv_ops(microbatch)
            if role == "recv"
            else stage.get_bwd_send_ops(microbatch)
        )

    def _step_microbatches(
        self,
        arg_mbs: list | None = None,
        kwarg_mbs: list | None = None,
        target_mbs: list | None = None,
        losses: list | None = None,
        return_outputs: bool = True,
        loss_kwargs: dict[str, Any] | None = None,
    ) -> None:
        """One step: every action of this stage's program, in order."""
        arg_mbs, kwarg_mbs = self._check_inputs(arg_mbs, kwarg_mbs, target_mbs, losses)
        first_target = target_mbs[0] if target_mbs is not None else None
        self._initialize_stage(arg_mbs[0], kwarg_mbs[0], first_target, loss_kwargs)
        posted: dict[tuple, list[dist.Work]] = {}
        last = self._n_microbatches - 1
        for action in self.actions:
            kind = action[0]
            if kind == "post":
                posted[action[1]] = _start(self._ops(action[1], action[2]))
            elif kind == "wait":
                for key in action[1]:
                    for work in posted.pop(key):
                        work.wait()
            elif action[1] == "F":
                i = action[2]
                output = self._stage.forward_one_chunk(
                    i, arg_mbs[i], kwarg_mbs[i], save_forward_output=return_outputs
                )
                self._maybe_compute_loss(self._stage, output, target_mbs, i, loss_kwargs)
            elif action[1] == "R":
                if self.recompute is not None and action[3:] != (IN_BACKWARD,):
                    self.recompute()
            else:
                i = action[2]
                loss = self._maybe_get_loss(self._stage, i)
                self._stage.backward_one_chunk(i, loss=loss, last_backward=i == last)
        if posted:
            raise RuntimeError(f"the {self.schedule_name} program left {sorted(posted)} unwaited")
        self._update_losses(self._stage, losses)
        self._stage.perform_reduce_grad(self._n_microbatches if self.scale_grads else 1)

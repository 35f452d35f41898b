"""Pipeline schedules as programs: what each stage does, in order, in one training step.

A program is a list of actions of three kinds, the same for the runtime
(:mod:`thinwire.parallel.program_schedule` runs them on PyTorch's ``PipelineStage``) and for
the planner's simulator (:mod:`thinwire.plan.schedule_sim` times them):

* ``("post", key, "recv" | "send")``: start receiving or sending one message, without
  waiting; ``key = (direction, boundary, microbatch)``, ``direction`` ``"fwd"`` (an
  activation from stage ``boundary`` to ``boundary + 1``) or ``"bwd"`` (its gradient back);
* ``("wait", [key, ...])``: wait until those posted messages are received or sent;
* ``("compute", kind, microbatch)``: ``"F"`` forward, ``"R"`` recompute (the checkpointed
  blocks' forward again, :mod:`thinwire.parallel.recompute`), ``"B"`` backward; a
  recomputation the backward runs itself carries a fourth element, ``"in-backward"``.

``gpipe`` and ``1f1b`` post and wait exactly where PyTorch's ``ScheduleGPipe`` and
``Schedule1F1B`` do; a recomputing stage recomputes right before each backward, once the
gradient is in (as PyTorch's schedules do, inside the backward). ``shifted-1f1b`` is 1F1B
with Merak's shifted critical path (Lai et al., TPDS 2023): a stage posts the receive of a
micro-batch's gradient, recomputes that micro-batch while the gradient travels, and only
then waits for it, so the recomputation leaves the critical path; the first backward's
recomputation moves into the warm-up's wait for the first gradient. The last stage, whose
gradient is its own loss, has nothing to wait for: it recomputes (if at all: stage-aware
ratios mostly spare it) inside its backward, as 1F1B does, after the head's backward has
freed the head's activations.
"""

from __future__ import annotations

from collections.abc import Iterator

#: the schedules written as programs here
PROGRAM_SCHEDULES = ("gpipe", "1f1b", "shifted-1f1b")

FWD, BWD = "fwd", "bwd"
#: marks a recomputation the backward runs (after the parts behind the checkpointed
#: blocks have run theirs), not an action of its own
IN_BACKWARD = "in-backward"

Action = tuple  # ("post", key, role) | ("wait", keys) | ("compute", kind, microbatch)


def _backward(i: int, recompute: bool) -> Iterator[Action]:
    if recompute:  # the backward itself recomputes: an executor leaves it to the backward
        yield ("compute", "R", i, IN_BACKWARD)
    yield ("compute", "B", i)


def _gpipe(stage: int, stages: int, m: int, recompute: bool) -> Iterator[Action]:
    first, last = stage == 0, stage == stages - 1
    sends: list[tuple] = []
    for i in range(m):
        if not first:
            yield ("post", (FWD, stage - 1, i), "recv")
            yield ("wait", [(FWD, stage - 1, i)])
        yield ("compute", "F", i)
        if not last:
            yield ("post", (FWD, stage, i), "send")
            sends.append((FWD, stage, i))
    yield ("wait", sends)
    sends = []
    for i in range(m):
        if not last:
            yield ("post", (BWD, stage, i), "recv")
            yield ("wait", [(BWD, stage, i)])
        yield from _backward(i, recompute)
        if not first:
            yield ("post", (BWD, stage - 1, i), "send")
            sends.append((BWD, stage - 1, i))
    yield ("wait", sends)


def _one_f_one_b(
    stage: int, stages: int, m: int, recompute: bool, shifted: bool
) -> Iterator[Action]:
    first, last = stage == 0, stage == stages - 1
    # recompute while the gradient travels; the last stage has none to wait for, and
    # recomputes inside its backward, once the head's backward has freed its activations
    early = recompute and shifted and not last
    warmup = min(m, stages - stage)
    fwd = bwd = 0
    send_work: list[tuple] = []
    fwd_sends: list[tuple] = []
    for _ in range(warmup):
        if not first:
            yield ("post", (FWD, stage - 1, fwd), "recv")
            yield ("wait", [(FWD, stage - 1, fwd)])
        yield ("compute", "F", fwd)
        yield ("wait", send_work)
        fwd_sends = [] if last else [(FWD, stage, fwd)]
        if fwd != warmup - 1:
            for key in fwd_sends:
                yield ("post", key, "send")
            send_work, fwd_sends = fwd_sends, []
        fwd += 1
    while True:
        bwd_recvs = [] if last else [(BWD, stage, bwd)]
        for key in fwd_sends:
            yield ("post", key, "send")
        for key in bwd_recvs:
            yield ("post", key, "recv")
        if early:
            yield ("compute", "R", bwd)
        yield ("wait", fwd_sends + bwd_recvs)
        yield from _backward(bwd, recompute and not early)
        bwd_sends = [] if first else [(BWD, stage - 1, bwd)]
        bwd += 1
        if fwd == m:
            break
        fwd_recvs = [] if first else [(FWD, stage - 1, fwd)]
        for key in bwd_sends:
            yield ("post", key, "send")
        for key in fwd_recvs:
            yield ("post", key, "recv")
        yield ("wait", bwd_sends + fwd_recvs)
        yield ("compute", "F", fwd)
        fwd_sends = [] if last else [(FWD, stage, fwd)]
        fwd += 1
    for key in bwd_sends:
        yield ("post", key, "send")
    send_work = bwd_sends
    while bwd < m:
        recvs = [] if last else [(BWD, stage, bwd)]
        for key in recvs:
            yield ("post", key, "recv")
        if early:
            yield ("compute", "R", bwd)
        yield ("wait", recvs)
        yield from _backward(bwd, recompute and not early)
        yield ("wait", send_work)
        send_work = [] if first else [(BWD, stage - 1, bwd)]
        for key in send_work:
            yield ("post", key, "send")
        bwd += 1
    yield ("wait", send_work)


def program(
    schedule: str, stage: int, stages: int, microbatches: int, recompute: bool = False
) -> list[Action]:
    """The actions stage ``stage`` of ``stages`` runs for one step of ``schedule`` over
    ``microbatches`` micro-batches; ``recompute``: the stage has checkpointed blocks."""
    if schedule not in PROGRAM_SCHEDULES:
        raise ValueError(
            f"no program for schedule {schedule!r}: one of {', '.join(PROGRAM_SCHEDULES)}"
        )
    if schedule == "gpipe":
        return list(_gpipe(stage, stages, microbatches, recompute))
    return list(
        _one_f_one_b(stage, stages, microbatches, recompute, shifted=schedule == "shifted-1f1b")
    )

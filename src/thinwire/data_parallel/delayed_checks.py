"""Checks :class:`~thinwire.DelayedAveraging` makes beyond ``DistributedOptimizer``'s: that
every rank uses the same delay, lanes and optimizer settings (:func:`agree_on_settings`,
collective), and that this rank's gradient is finite before its local step
(:func:`refuse_non_finite`)."""

from __future__ import annotations

import torch
from torch import nn

from thinwire.comm.agreement import digest, value_ranges
from thinwire.comm.engine import GradientExchange
from thinwire.compress.finite import FiniteChecks
from thinwire.errors import NonFiniteGradientError, RankMismatchError


def refuse_non_finite(buckets: list[list[tuple[str, nn.Parameter]]], step: int, rank: int) -> None:
    """Raise before the local step if this rank's gradient has NaN or Inf (the engine's
    check, of the live gradients: the exchange thread owns the copies): it is not
    applied here, and the exchange already started fails on every rank when its
    correction is due. ``step`` is the pending step's number, ``rank`` this rank's."""
    grads = [(name, p.grad) for bucket in buckets for name, p in bucket]
    grads = [(name, g) for name, g in grads if g is not None]
    checks = FiniteChecks()
    for i, (_, grad) in enumerate(grads):
        checks.add(i, grad)
    bad = [grads[i][0] for i in checks.failed()]
    if not bad:
        return
    raise NonFiniteGradientError(
        f"non-finite gradient (NaN or Inf) at step {step}, on this rank "
        f"({rank}) in {', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}; "
        "DelayedAveraging did not apply it on this rank, and every rank's correction of "
        "that step will fail. Lower the learning rate, clip gradients, or check the loss "
        "and the input data for NaN/Inf."
    )


def agree_on_settings(
    engine: GradientExchange, delay: int, lanes: int, optimizer: torch.optim.Optimizer
) -> None:
    """Check that every rank uses the same delay, lanes and optimizer (class and every
    group's settings), in one all-reduce (:func:`value_ranges`); all ranks raise
    :class:`RankMismatchError` naming what differs. Collective: every rank calls it."""
    settings = repr(
        [type(optimizer).__name__]
        + [
            sorted((k, repr(v)) for k, v in g.items() if k != "params")
            for g in optimizer.param_groups
        ]
    )
    (delays, lane_counts, digests) = value_ranges(
        [delay, lanes, digest(settings)], engine.communicator.group
    )
    problems = [
        f"this rank has {name}={value}, the ranks' range from {lowest} to {highest}"
        for name, value, (lowest, highest) in (
            ("delay", delay, delays),
            ("lanes", lanes, lane_counts),
        )
        if lowest != highest
    ]
    if digests[0] != digests[1]:
        problems.append(
            f"the ranks' optimizers differ in class or settings (this rank: "
            f"{type(optimizer).__name__}, {len(optimizer.param_groups)} group(s))"
        )
    if problems:
        raise RankMismatchError(
            f"ranks disagree (seen from rank {engine.rank}): {'; '.join(problems)}. Every "
            "rank must construct DelayedAveraging with the same delay and lanes, over the "
            "same optimizer with the same settings."
        )

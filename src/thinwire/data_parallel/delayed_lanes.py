"""The exchanges :class:`~thinwire.DelayedAveraging` keeps in flight: the lanes they run on
(one engine and process group per exchange that may be in flight at once), the record of
each step whose correction is pending, and waiting for one step's exchange."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from thinwire.comm.collectives import sibling_group
from thinwire.comm.engine import GradientExchange
from thinwire.compress.feedback import NoMemory
from thinwire.data_parallel.replay import Hyper
from thinwire.errors import NonFiniteGradientError


@dataclass
class Pending:
    """One step whose correction is not applied yet: per bucket, the buffers that hold this
    rank's gradients and, once the future resolves, ``avg - own``; the learning rate and
    weight decay and momentum of every parameter group when the local step was taken."""

    deltas: list[list[Tensor]]
    futures: list[torch.futures.Future]
    rates: list[tuple[float, float, float]]
    step: int = 0
    #: replay only: this rank's gradients (by parameter id) and the groups' settings
    own: dict[int, Tensor] | None = None
    hyper: Hyper | None = None


def extra_lanes(
    engine: GradientExchange, lanes: int, group: dist.ProcessGroup | None
) -> list[GradientExchange]:
    """Engines 1 .. lanes-1 beside ``engine`` (lane 0), each on a new process group over the
    same ranks as ``group``. Refused for an engine that carries state from one step to the
    next (error feedback, a stateful compressor): its steps must run in order."""
    if lanes == 1:
        return []
    if not engine.compressor.stateless or not isinstance(engine.memory, NoMemory):
        raise ValueError(
            f"lanes={lanes} runs several steps' exchanges at once, but compressor "
            f"{engine.compressor.name!r} with {type(engine.memory).__name__} carries state "
            "from one step to the next (error feedback, warm starts, random streams), so "
            "its steps must run in order: use lanes=1, or a stateless compressor "
            "(none, fp16, bf16)"
        )
    extra = []
    for _ in range(lanes - 1):
        lane_group = sibling_group(group)
        extra.append(
            GradientExchange(
                copy.deepcopy(engine.compressor),
                communicator=engine.communicator.name,
                memory=NoMemory(),
                group=lane_group,
            )
        )
    return extra


def wait_exchange(future: torch.futures.Future) -> None:
    """Wait for one exchange; a non-finite average says what it means under a delay."""
    try:
        future.wait()
    except NonFiniteGradientError as error:
        raise NonFiniteGradientError(
            f"{error} Under DelayedAveraging every rank has taken its own steps since that "
            "step, so the ranks' weights no longer agree: restore every rank from the last "
            "checkpoint (saved after flush())."
        ) from error

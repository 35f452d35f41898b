"""Transport: collectives, process groups and timeouts, the rank-agreement check, byte
framing, the exchange thread, and the gradient exchange engine that drives them.

Nothing here knows DDP or optimizers: the data-parallel front ends
(:mod:`thinwire.data_parallel`) hand the engine a step's gradients.
"""

from thinwire.comm.collectives import (
    AllGatherCommunicator,
    AllReduceCommunicator,
    Communicator,
    make_communicator,
)
from thinwire.comm.engine import GradientExchange, GradientItem, StepStats

__all__ = [
    "AllGatherCommunicator",
    "AllReduceCommunicator",
    "Communicator",
    "GradientExchange",
    "GradientItem",
    "StepStats",
    "make_communicator",
]

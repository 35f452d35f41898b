"""Communication: collectives, the exchange engine and its front ends."""

from thinwire.comm.buckets import tapered_buckets
from thinwire.comm.collectives import (
    AllGatherCommunicator,
    AllReduceCommunicator,
    Communicator,
    make_communicator,
)
from thinwire.comm.ddp_hook import register
from thinwire.comm.engine import GradientExchange, GradientItem, StepStats
from thinwire.comm.optimizer import DistributedOptimizer

__all__ = [
    "AllGatherCommunicator",
    "AllReduceCommunicator",
    "Communicator",
    "DistributedOptimizer",
    "GradientExchange",
    "GradientItem",
    "StepStats",
    "make_communicator",
    "register",
    "tapered_buckets",
]

"""Network analysis: what a data-parallel step costs on a given network, per method.

    from thinwire.plan import Link, profile_task
    profile = profile_task(task, {"dense": {}, "dgc": {"density": 0.001}}, world_size=4)
    link = Link(bandwidth_bps=100e6, latency_s=1e-3)       # mtu=cluster.mtu if emulated
    profile.predict("dgc", link).step_s                     # this process's compute
    profile.predict("dgc", link, compute=local_step_s)      # calibrated to a measured one

:mod:`thinwire.plan.network` (links, alpha-beta collectives), :mod:`thinwire.plan.topology`
(link levels: which link a group's collectives run at), :mod:`thinwire.plan.cost` (a
step's timeline) and :mod:`thinwire.plan.breakeven` are the pure model (numbers in, numbers out);
:mod:`thinwire.plan.profile` measures compute, traffic and compression time in this
process, each method the way its strategy's ``costing`` says (the methods are the training
strategies of :mod:`thinwire.strategies`); :mod:`thinwire.plan.report` renders a plan as a
table or JSON; :mod:`thinwire.plan.memory` measures what a rank holds (parameters,
gradients, optimizer and exchange state).
"""

from thinwire.plan.breakeven import BreakEven, break_even_bandwidth, plan
from thinwire.plan.cost import (
    BucketCost,
    ComputeTime,
    MethodCost,
    StepPrediction,
    predict_step,
    step_time,
)
from thinwire.plan.memory import MemoryEstimate, data_parallel_memory
from thinwire.plan.network import (
    ALLGATHER,
    ALLREDUCE,
    ALLTOALL,
    DIRECT,
    PACED,
    Collective,
    Link,
    broadcast_time,
    collective_time,
    wire_bytes,
)
from thinwire.plan.profile import (
    ComputeProfile,
    Profile,
    ddp_buckets,
    measure_compute,
    measure_method,
    profile_model,
    profile_task,
)
from thinwire.plan.topology import Topology

__all__ = [
    "ALLGATHER",
    "ALLREDUCE",
    "ALLTOALL",
    "DIRECT",
    "PACED",
    "BreakEven",
    "BucketCost",
    "Collective",
    "ComputeProfile",
    "ComputeTime",
    "Link",
    "MemoryEstimate",
    "MethodCost",
    "Profile",
    "StepPrediction",
    "Topology",
    "break_even_bandwidth",
    "broadcast_time",
    "collective_time",
    "data_parallel_memory",
    "ddp_buckets",
    "measure_compute",
    "measure_method",
    "plan",
    "predict_step",
    "profile_model",
    "profile_task",
    "step_time",
    "wire_bytes",
]

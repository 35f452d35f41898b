"""Data-parallel strategies on the gradient exchange engine (:mod:`thinwire.comm`).

- :mod:`~thinwire.data_parallel.ddp_hook`: ``thinwire.register(ddp_model, "dgc")``;
- :mod:`~thinwire.data_parallel.optimizer`: ``DistributedOptimizer`` for code without DDP;
- :mod:`~thinwire.data_parallel.buckets`: bucket plans (``tapered_buckets``);
- :mod:`~thinwire.data_parallel.delayed`: delayed gradient averaging (its lanes, checks and
  closed-form correction in ``delayed_lanes``, ``delayed_checks``, ``delayed_correction``,
  the replay of optimizers without one in ``replay``);
- :mod:`~thinwire.data_parallel.local_steps`: DiLoCo and local SGD (synchronise every H steps);
- :mod:`~thinwire.data_parallel.parameter_server`: a sharded parameter server, sync or async;
- :mod:`~thinwire.data_parallel.sparse`: embedding tables sharded over the ranks.
"""

from thinwire.data_parallel.buckets import tapered_buckets
from thinwire.data_parallel.ddp_hook import register
from thinwire.data_parallel.delayed import DelayedAveraging
from thinwire.data_parallel.local_steps import DiLoCo, LocalSGD
from thinwire.data_parallel.optimizer import DistributedOptimizer
from thinwire.data_parallel.parameter_server import ParameterServer

__all__ = [
    "DelayedAveraging",
    "DiLoCo",
    "DistributedOptimizer",
    "LocalSGD",
    "ParameterServer",
    "register",
    "tapered_buckets",
]

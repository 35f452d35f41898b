"""thinwire: distributed PyTorch training that is fast on cheap networks.

import thinwire
thinwire.compressors()                              # names and one-line summaries
engine = thinwire.register(ddp_model, "dgc", density=0.001)   # DDP hook
opt = thinwire.DistributedOptimizer(torch.optim.SGD(...), model, "powersgd", rank=2)
ddp = DistributedDataParallel(model, bucket_cap_mb_list=thinwire.tapered_buckets(model))
trainer = thinwire.parallelize(model, thinwire.ParallelPlan(dp=2, pp=2, tp=2), optimizer=...)
trainer = thinwire.parallelize(model, "auto", optimizer=..., example_inputs=(tokens, targets))
"""

from thinwire.auto import auto_plan, parallelize
from thinwire.checkpoint import Checkpoints
from thinwire.comm import GradientExchange, StepStats
from thinwire.compress import Compressor, compressor, compressors, register_compressor
from thinwire.data_parallel import (
    DelayedAveraging,
    DiLoCo,
    DistributedOptimizer,
    LocalSGD,
    ParameterServer,
    register,
    tapered_buckets,
)
from thinwire.errors import (
    CheckpointError,
    CommunicationError,
    IncompatibleCompressorError,
    NonFiniteGradientError,
    RankMismatchError,
    ThinwireError,
)
from thinwire.parallel import ModelLayout, ParallelPlan, ParallelTrainer

__all__ = [
    "CheckpointError",
    "Checkpoints",
    "CommunicationError",
    "Compressor",
    "DelayedAveraging",
    "DiLoCo",
    "DistributedOptimizer",
    "GradientExchange",
    "IncompatibleCompressorError",
    "LocalSGD",
    "ModelLayout",
    "NonFiniteGradientError",
    "ParallelPlan",
    "ParallelTrainer",
    "ParameterServer",
    "RankMismatchError",
    "StepStats",
    "ThinwireError",
    "auto_plan",
    "compressor",
    "compressors",
    "parallelize",
    "register",
    "register_compressor",
    "tapered_buckets",
]
__version__ = "0.1.0"

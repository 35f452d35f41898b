"""thinwire: distributed PyTorch training that is fast on cheap networks.

import thinwire
thinwire.compressors()                              # names and one-line summaries
engine = thinwire.register(ddp_model, "dgc", density=0.001)   # DDP hook
opt = thinwire.DistributedOptimizer(torch.optim.SGD(...), model, "powersgd", rank=2)
ddp = DistributedDataParallel(model, bucket_cap_mb_list=thinwire.tapered_buckets(model))
"""

from thinwire.comm import GradientExchange, StepStats
from thinwire.compress import Compressor, compressor, compressors, register_compressor
from thinwire.data_parallel import (
    DelayedAveraging,
    DistributedOptimizer,
    ParameterServer,
    register,
    tapered_buckets,
)
from thinwire.errors import (
    CommunicationError,
    IncompatibleCompressorError,
    NonFiniteGradientError,
    RankMismatchError,
    ThinwireError,
)

__all__ = [
    "CommunicationError",
    "Compressor",
    "DelayedAveraging",
    "DistributedOptimizer",
    "GradientExchange",
    "IncompatibleCompressorError",
    "NonFiniteGradientError",
    "ParameterServer",
    "RankMismatchError",
    "StepStats",
    "ThinwireError",
    "compressor",
    "compressors",
    "register",
    "register_compressor",
    "tapered_buckets",
]
__version__ = "0.1.0"

"""thinwire: distributed PyTorch training that is fast on cheap networks.

import thinwire
thinwire.compressors()                              # names and one-line summaries
engine = thinwire.register(ddp_model, "dgc", density=0.001)   # DDP hook
opt = thinwire.DistributedOptimizer(torch.optim.SGD(...), model, "powersgd", rank=2)
ddp = DistributedDataParallel(model, bucket_cap_mb_list=thinwire.tapered_buckets(model))
trainer = thinwire.parallelize(model, thinwire.ParallelPlan(dp=2, pp=2, tp=2), optimizer=...)
trainer = thinwire.parallelize(model, "auto", optimizer=..., example_inputs=(tokens, targets))

The names are imported when first used (:pep:`562`): a data-parallel job never loads the
hybrid-parallel half (DTensor, pipelining and with them ``torch._dynamo``), which halves
the CPU time each of its ranks spends importing thinwire.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from thinwire import exit_grace  # noqa: F401  (its exit handler: gloo's workers at exit)

if TYPE_CHECKING:
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
        NonFiniteGradientWarning,
        RankMismatchError,
        ThinwireError,
    )
    from thinwire.parallel import ModelLayout, ParallelPlan, ParallelTrainer

#: each public name and the module that defines it
_HOMES = {
    "auto_plan": "thinwire.auto",
    "parallelize": "thinwire.auto",
    "Checkpoints": "thinwire.checkpoint",
    "GradientExchange": "thinwire.comm",
    "StepStats": "thinwire.comm",
    "Compressor": "thinwire.compress",
    "compressor": "thinwire.compress",
    "compressors": "thinwire.compress",
    "register_compressor": "thinwire.compress",
    "DelayedAveraging": "thinwire.data_parallel",
    "DiLoCo": "thinwire.data_parallel",
    "DistributedOptimizer": "thinwire.data_parallel",
    "LocalSGD": "thinwire.data_parallel",
    "ParameterServer": "thinwire.data_parallel",
    "register": "thinwire.data_parallel",
    "tapered_buckets": "thinwire.data_parallel",
    "CheckpointError": "thinwire.errors",
    "CommunicationError": "thinwire.errors",
    "IncompatibleCompressorError": "thinwire.errors",
    "NonFiniteGradientError": "thinwire.errors",
    "NonFiniteGradientWarning": "thinwire.errors",
    "RankMismatchError": "thinwire.errors",
    "ThinwireError": "thinwire.errors",
    "ModelLayout": "thinwire.parallel",
    "ParallelPlan": "thinwire.parallel",
    "ParallelTrainer": "thinwire.parallel",
}

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
    "NonFiniteGradientWarning",
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


def __getattr__(name: str) -> Any:
    """``thinwire.<name>``: imports the module that defines it on first use."""
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'thinwire' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The public names and the module's own."""
    return sorted({*globals(), *_HOMES})

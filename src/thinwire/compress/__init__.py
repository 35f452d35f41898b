"""Gradient compressors, one algorithm per module, registered by name."""

from thinwire.compress import (  # noqa: F401  (importing registers them)
    bf16,
    dgc,
    fp16,
    none,
    onebit,
    powersgd,
    powersgd_oneround,
    qsgd,
    randomk,
    signsgd,
    terngrad,
    topk,
)
from thinwire.compress.base import (
    Aggregation,
    Compressor,
    Exchanged,
    Memory,
    Op,
    Request,
    Slot,
    run_locally,
)
from thinwire.compress.registry import compressor, compressors, register_compressor

__all__ = [
    "Aggregation",
    "Compressor",
    "Exchanged",
    "Memory",
    "Op",
    "Request",
    "Slot",
    "compressor",
    "compressors",
    "register_compressor",
    "run_locally",
]

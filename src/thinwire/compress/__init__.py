"""Gradient compressors, one algorithm per module, registered by name."""

from thinwire.compress import dgc, none, powersgd, randomk, topk  # noqa: F401  (registers them)
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

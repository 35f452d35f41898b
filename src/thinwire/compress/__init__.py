"""Gradient compressors, one algorithm per module, registered by name.

Every module of this package is imported here, so a compressor's module registers itself
(``@register_compressor``) just by being in the package: adding one is adding a file.
"""

import importlib
import pkgutil

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

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

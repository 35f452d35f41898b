"""Training strategies, one module each, registered by name (:mod:`.registry`).

A strategy is how a model trains over several ranks: DDP with or without a hook, a thinwire
compressor, delayed averaging, a parameter server, sparse embedding tables. Each module
holds the strategy's options and their checks, how it wraps a model and optimizer
(:meth:`~thinwire.strategies.base.Strategy.wrap`) and how the planner costs it
(:attr:`~thinwire.strategies.base.Strategy.costing`, ``schedule``). ``thinwire bench``,
``thinwire plan`` and the profiler look strategies up by name and switch on nothing else.
"""

import importlib
import pkgutil

from thinwire.strategies.base import Strategy, Wrapped, WrapSetup
from thinwire.strategies.registry import (
    register_strategy,
    strategies,
    strategy,
    strategy_names,
    unregister_strategy,
)

__all__ = [
    "Strategy",
    "WrapSetup",
    "Wrapped",
    "register_strategy",
    "strategies",
    "strategy",
    "strategy_names",
    "unregister_strategy",
]

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

"""Strategies by name: the one place that decides what a method name means.

    strategy("dgc")            # a thinwire compressor under DDP's hook
    strategy("dga").options({"delay": 1})
    strategies()               # every name and its one-line summary

Every module of :mod:`thinwire.strategies` is imported when the package is, so a strategy
registers itself (``@register_strategy``) by being in the package; every registered thinwire
compressor is also a strategy (:class:`~thinwire.strategies.compressed.Compressed`) under its
own name.
"""

from __future__ import annotations

from typing import TypeVar

from thinwire.strategies.base import COSTINGS, SCHEDULES, Strategy

_REGISTRY: dict[str, Strategy] = {}

S = TypeVar("S", bound=type[Strategy])


def register_strategy(cls: S) -> S:
    """Class decorator: make an instance of ``cls`` available under ``cls.name``."""
    if cls.costing not in COSTINGS:
        raise ValueError(f"{cls.__name__}.costing must be one of {COSTINGS}, got {cls.costing!r}")
    if cls.schedule not in SCHEDULES:
        raise ValueError(
            f"{cls.__name__}.schedule must be one of {SCHEDULES}, got {cls.schedule!r}"
        )
    if cls.name in _REGISTRY and type(_REGISTRY[cls.name]) is not cls:
        raise ValueError(f"strategy name {cls.name!r} is already taken by {_REGISTRY[cls.name]}")
    _REGISTRY[cls.name] = cls()
    return cls


def unregister_strategy(name: str) -> None:
    """Forget the strategy registered as ``name`` (for plug-ins and their tests)."""
    _REGISTRY.pop(name, None)


def strategy(name: str) -> Strategy:
    """The strategy called ``name``: a registered one, else a thinwire compressor under
    DDP's hook; unknown names raise ``ValueError`` listing every name."""
    _load()
    if name in _REGISTRY:
        return _REGISTRY[name]
    from thinwire.compress.registry import compressors
    from thinwire.strategies.compressed import Compressed

    if name in compressors():
        return Compressed(name)
    raise ValueError(f"unknown method {name!r}; choose one of: {', '.join(strategy_names())}")


def strategy_names() -> list[str]:
    """Every name: the registered strategies, then the thinwire compressors."""
    return list(strategies())


def strategies() -> dict[str, str]:
    """Every strategy's name and one-line summary (registered ones first)."""
    _load()
    from thinwire.compress.registry import compressors

    listed = {name: s.summary for name, s in _REGISTRY.items()}
    for name, summary in compressors().items():
        listed.setdefault(name, f"DDP + thinwire {name}: {summary}")
    return listed


def _load() -> None:
    import thinwire.strategies  # noqa: F401  (importing the package registers them)

"""Compressors by name: ``thinwire.compressor("dgc", density=0.001)``."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, TypeVar

from thinwire.compress.base import Compressor

_REGISTRY: dict[str, type[Compressor]] = {}

C = TypeVar("C", bound=type[Compressor])


def register_compressor(cls: C) -> C:
    """Class decorator: make ``cls`` available under ``cls.name``."""
    name = cls.name
    if name in _REGISTRY and _REGISTRY[name] is not cls:
        raise ValueError(f"compressor name {name!r} is already taken by {_REGISTRY[name]}")
    _REGISTRY[name] = cls
    return cls


def compressor(name: str | Compressor, **options: Any) -> Compressor:
    """Build the compressor registered as ``name`` with ``options`` (an instance is
    returned as it is).

    Unknown names and unknown options raise an error that lists what is available.
    """
    _load_builtin()
    if isinstance(name, Compressor):
        if options:
            raise ValueError("options were given together with a ready-made compressor")
        return name
    try:
        cls = _REGISTRY[name]
    except KeyError:
        known = ", ".join(sorted(_REGISTRY))
        raise ValueError(f"unknown compressor {name!r}; choose one of: {known}") from None
    accepted = _option_names(cls)
    unknown = sorted(set(options) - accepted)
    if unknown:
        raise ValueError(
            f"compressor {name!r} has no option(s) {', '.join(unknown)}; "
            f"its options are: {', '.join(sorted(accepted)) or 'none'}"
        )
    return cls(**options)


def compressors() -> dict[str, str]:
    """Every registered compressor's name and one-line summary, sorted by name."""
    _load_builtin()
    return {name: _REGISTRY[name].summary for name in sorted(_REGISTRY)}


def compressor_class(name: str) -> type[Compressor]:
    """The class registered as ``name`` (for documentation and introspection)."""
    _load_builtin()
    return _REGISTRY[name]


def _option_names(cls: type[Compressor]) -> set[str]:
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls) if f.init}
    params = inspect.signature(cls.__init__).parameters
    return {p for p in params if p != "self"}


def _load_builtin() -> None:
    # Importing the package registers the built-in compressors once.
    import thinwire.compress  # noqa: F401

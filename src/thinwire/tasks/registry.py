"""Tasks by name: ``thinwire.tasks.task("fashion", batch_size=32)``."""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

from thinwire.tasks.base import Task

_REGISTRY: dict[str, type[Task]] = {}

T = TypeVar("T", bound=type[Task])


def register_task(cls: T) -> T:
    """Class decorator: make the dataclass ``cls`` available under ``cls.name``."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls.__name__} must be a dataclass (its fields are its options)")
    name = cls.name
    if name in _REGISTRY and _REGISTRY[name] is not cls:
        raise ValueError(f"task name {name!r} is already taken by {_REGISTRY[name]}")
    _REGISTRY[name] = cls
    return cls


def task(name: str | Task, **options: Any) -> Task:
    """Build the task registered as ``name`` with ``options`` (an instance is returned as it is).

    Unknown names and unknown options raise an error that lists what is available.
    """
    _load_builtin()
    if isinstance(name, Task):
        if options:
            raise ValueError("options were given together with a ready-made task")
        return name
    cls = task_class(name)
    accepted = task_options(name)
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ValueError(
            f"task {name!r} has no option(s) {', '.join(unknown)}; "
            f"its options are: {', '.join(sorted(accepted)) or 'none'}"
        )
    return cls(**options)


def tasks() -> dict[str, str]:
    """Every registered task's name and one-line summary, sorted by name."""
    _load_builtin()
    return {name: _REGISTRY[name].summary for name in sorted(_REGISTRY)}


def task_class(name: str) -> type[Task]:
    """The class registered as ``name`` (for documentation and introspection)."""
    _load_builtin()
    try:
        return _REGISTRY[name]
    except KeyError:
        known = ", ".join(sorted(_REGISTRY))
        raise ValueError(f"unknown task {name!r}; choose one of: {known}") from None


def task_options(name: str) -> dict[str, Any]:
    """The options of task ``name`` with their defaults (``dataclasses.MISSING``: required)."""
    options: dict[str, Any] = {}
    for field in dataclasses.fields(task_class(name)):
        if field.init:
            factory = field.default_factory
            options[field.name] = field.default if factory is dataclasses.MISSING else factory()
    return options


def _load_builtin() -> None:
    # Importing the package registers the built-in tasks once.
    import thinwire.tasks  # noqa: F401
